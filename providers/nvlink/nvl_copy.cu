// Gather/scatter copy kernel of the nvlink provider: one launch moves every page of a paged
// write (never one copy call per page: one cudaMemcpyPeerAsync per 32 KiB page reaches
// 4.5 GB/s on the H200 pair, one launch of this kernel ~370 GB/s).
//
// Page k copies page_len bytes from src_base + src_idx[k] * src_stride to
// dst_base + dst_idx[k] * dst_stride; idx points at the two index arrays back to back
// (src_idx[count] then dst_idx[count]) in device memory. One warp per page, pages taken
// grid-stride; 16-byte loads and stores when both addresses and the length allow, bytes
// otherwise. The destination is usually peer memory mapped through CUDA IPC: the stores go
// over NVLink.
//
// Not compiled at build time (nothing links or needs CUDA to build afabric): nvl_copy_ptx.h
// holds the PTX, regenerated with `python providers/nvlink/gen_ptx.py` (needs nvcc); the
// driver JIT-compiles it for whatever GPU is present.

typedef unsigned long long u64;

extern "C" __global__ void __launch_bounds__(256)
afnv_paged_copy(u64 src_base, u64 src_stride, u64 dst_base, u64 dst_stride, u64 page_len,
                u64 count, const long long *idx)
{
    const unsigned lane = threadIdx.x & 31u;
    const u64 warp = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 p = warp; p < count; p += warps) {
        const char *s = (const char *)(src_base + (u64)idx[p] * src_stride);
        char *d = (char *)(dst_base + (u64)idx[count + p] * dst_stride);
        if ((((u64)s | (u64)d | page_len) & 15u) == 0) {
            const uint4 *s4 = (const uint4 *)s;
            uint4 *d4 = (uint4 *)d;
            const u64 n = page_len >> 4;
            u64 i = lane;
            for (; i + 96 < n; i += 128) { // four 16-byte loads in flight per lane
                uint4 a = s4[i], b = s4[i + 32], c = s4[i + 64], e = s4[i + 96];
                d4[i] = a;
                d4[i + 32] = b;
                d4[i + 64] = c;
                d4[i + 96] = e;
            }
            for (; i < n; i += 32)
                d4[i] = s4[i];
        } else {
            for (u64 i = lane; i < page_len; i += 32)
                d[i] = s[i];
        }
    }
}
