// MoE dispatch/combine token shuffling (compiled by afabric/moe/kernels.py with NVRTC).
//
// Every rank owns one staging slot per (parity, source) in its receive buffer. A sender
// writes each token once per destination rank (not once per expert): its row, and for
// each of its top-k entries the destination-local expert (or -1) and the routing weight.
// The receiver expands the slots into the expert-major output itself, over its own HBM.
// Peers on the same node are written directly over NVLink (CUDA IPC pointers); peers
// behind the host proxy are written into this rank's pinned send region, which the shim
// posts when the kernel bumps the watcher word. The epoch of a call is stored into each
// NVLink peer's flag word last; receivers spin until every source's flag reaches it.
// Epochs live on the device (ep[0] dispatch, ep[1] combine: the send kernel takes the next
// one and stores it when done, the receive kernels read it), and so does the choice of
// slots by call parity: no argument changes from call to call but the caller's tensors,
// so calls can be captured into CUDA graphs and replayed.
//
// No headers: bf16 conversions are done on the bits, fp8 rows are only moved.
// Built with -DOUT_FP32=0|1 (bf16 or fp32 expert outputs / combine results).

typedef unsigned long long u64;
typedef unsigned int u32;

#ifndef OUT_FP32
#define OUT_FP32 0
#endif

#if OUT_FP32
typedef float out_t;
__device__ __forceinline__ float out_to_f(out_t v) { return v; }
__device__ __forceinline__ out_t f_to_out(float f) { return f; }
#define OUT_PER_U4 4
#else
typedef unsigned short out_t;
__device__ __forceinline__ float out_to_f(out_t v) { return __uint_as_float(((u32)v) << 16); }
__device__ __forceinline__ out_t f_to_out(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (out_t)0x7fc0;  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);                              // round to nearest even
    return (out_t)(u >> 16);
}
#define OUT_PER_U4 8
#endif

// Slot layout (bytes, all 16-aligned; the same numbers as afabric/moe/config.py):
//   [0, 16)            header: int32 token count
//   [off_exp, ...)     T*K int32: destination-local expert per top-k entry, -1 if elsewhere
//   [off_wts, ...)     T*K float: routing weights
//   [off_rows, ...)    T rows of row_bytes: seg_a bytes of x then seg_b bytes of scales
struct Layout {
    long long off_exp, off_wts, off_rows, slot_bytes, row_bytes;
    int seg_a, seg_b;  // bytes of x per row (multiple of 16), of scales per row (multiple of 4)
    int T, K, E_local, N, me;
};

#define MAX_RANKS 64
#define ERR_CAPACITY 1u  // more (token, expert) entries than the expert-major capacity
#define ERR_EXPERT 2u    // an expert id >= num_experts (ignored)
#define ERR_TIMEOUT 4u   // a peer did not publish its epoch within the timeout

__device__ __forceinline__ u64 now_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ void st_release_sys(u64 *p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ u64 ld_acquire_sys(const u64 *p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The 8 pointer tables of a call's parity (alltoall._TABLES): tab[parity][w][N].
__device__ __forceinline__ const u64 *table(const u64 *tab, u64 epoch, int w, int N) {
    return tab + ((epoch & 1) * 8 + w) * (u64)N;
}
__device__ __forceinline__ u64 ld_volatile(const u64 *p) { return *(const volatile u64 *)p; }

// Spin until *flag >= epoch; give up (flagging ERR_TIMEOUT) after timeout_ns.
__device__ void wait_epoch(const u64 *flag, u64 epoch, u64 timeout_ns, u32 *err) {
    if (ld_acquire_sys(flag) >= epoch) return;
    const u64 start = now_ns();
    while (ld_acquire_sys(flag) < epoch) {
        if (now_ns() - start > timeout_ns) {
            if (err) atomicOr(err, ERR_TIMEOUT);
            return;
        }
    }
}

__device__ __forceinline__ int topk_at(const void *idx, int idx64, long long i) {
    return idx64 ? (int)((const long long *)idx)[i] : ((const int *)idx)[i];
}

// Grid-wide "last block out": every block fences its stores and counts itself; the block
// that counts last returns true (and resets the counter for the next call).
__device__ bool last_block(u32 *ctr) {
    __shared__ bool last;
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        u32 old = atomicAdd(ctr, 1u);
        last = (old == gridDim.x - 1);
        if (last) *ctr = 0;  // no other block touches it again in this launch
    }
    __syncthreads();
    return last;
}

// ---------------------------------------------------------------- dispatch: send

// Pass 0 writes the tokens for proxy destinations, bumps the watcher (the host learns
// early, before any NVLink store is issued), pass 1 the tokens for NVLink destinations,
// then the last block publishes counts and epochs to the NVLink peers. Tokens for this
// rank itself are not staged: only their routes, and tok_of[slot] = token, so that
// dispatch_copy reads their rows straight from x. Returns the call's epoch.
// dynamic shared memory: 2 * blockDim.x * N ints (slots and owned pairs of the current chunk).
__device__ __forceinline__ u64 send_tokens(
    const void *topk, int idx64, const float *weights, const char *x, long long x_stride,
    const char *scales, long long s_stride, int n_tok, const Layout *Lp, const u64 *tab,
    u64 *ep, u64 proxy_mask, u64 *watcher, int *slot_of, int *tok_of, u32 *ctr, u32 *err) {
    const Layout L = *Lp;
    const u64 epoch = ld_volatile(ep) + 1;  // every block reads it before last_block below
    const u64 *dst_slot = table(tab, epoch, 0, L.N), *dst_flag = table(tab, epoch, 1, L.N);
    extern __shared__ int s_slot[];  // [blockDim.x][N]
    __shared__ int s_warp[32][MAX_RANKS];
    __shared__ int s_carry[MAX_RANKS];
    __shared__ int s_npairs;
    int *s_pair = s_slot + blockDim.x * L.N;  // [blockDim.x * N]: owned (token, rank) pairs
    const int N = L.N, K = L.K, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nwarps = blockDim.x >> 5;
    const u64 all = (N >= 64) ? ~0ull : ((1ull << N) - 1);
    const u64 nv_mask = all & ~proxy_mask;

    for (int pass = 0; pass < 2; ++pass) {
        const u64 want = pass == 0 ? proxy_mask : nv_mask;
        if (pass == 1 && proxy_mask) {
            // every proxy-bound byte is in host memory: publish counts, then bump the watcher
            if (last_block(&ctr[0])) {
                if (threadIdx.x == 0) {
                    for (int r = 0; r < N; ++r)
                        if ((proxy_mask >> r) & 1) *(volatile int *)(dst_slot[r]) = s_carry[r];
                    __threadfence_system();
                    *(volatile u64 *)watcher = epoch;
                }
            }
            __syncthreads();  // s_carry is reset below
        }
        if (want == 0) continue;
        const bool first = pass == (proxy_mask ? 0 : 1);  // the pass that records slots
        for (int r = threadIdx.x; r < N; r += blockDim.x) s_carry[r] = 0;
        __syncthreads();
        for (int base = 0; base < n_tok; base += blockDim.x) {
            const int t = base + threadIdx.x;
            u64 mask = 0;
            if (t < n_tok)
                for (int k = 0; k < K; ++k) {
                    int e = topk_at(topk, idx64, (long long)t * K + k);
                    if (e >= 0 && e < L.E_local * N) mask |= 1ull << (e / L.E_local);
                    else if (e >= L.E_local * N && first && blockIdx.x == 0) atomicOr(err, ERR_EXPERT);
                }
            for (int r = 0; r < N; ++r) {
                u32 b = __ballot_sync(0xffffffffu, (mask >> r) & 1);
                if (lane == 0) s_warp[warp][r] = __popc(b);
                s_slot[threadIdx.x * N + r] = ((mask >> r) & 1) ? (int)__popc(b & ((1u << lane) - 1)) : -1;
            }
            __syncthreads();
            for (int r = 0; r < N; ++r)
                if ((mask >> r) & 1) {
                    int before = s_carry[r];
                    for (int w = 0; w < warp; ++w) before += s_warp[w][r];
                    s_slot[threadIdx.x * N + r] += before;
                }
            __syncthreads();
            for (int r = threadIdx.x; r < N; r += blockDim.x) {
                int tot = 0;
                for (int w = 0; w < nwarps; ++w) tot += s_warp[w][r];
                s_carry[r] += tot;
            }
            // the slot table (combine reads it) is written by the block owning the token
            if (first && t < n_tok && (t % gridDim.x) == blockIdx.x)
                for (int r = 0; r < N; ++r) slot_of[(long long)t * N + r] = s_slot[threadIdx.x * N + r];
            // list the (token, destination) pairs of this chunk that this block owns...
            if (threadIdx.x == 0) s_npairs = 0;
            __syncthreads();
            if (t < n_tok && (t % gridDim.x) == blockIdx.x)
                for (int r = 0; r < N; ++r)
                    if (((want >> r) & 1) && s_slot[threadIdx.x * N + r] >= 0)
                        s_pair[atomicAdd(&s_npairs, 1)] = threadIdx.x * MAX_RANKS + r;
            __syncthreads();
            // ...then every thread of the block copies a piece of them: routes, rows, scales
            const int np = s_npairs;
            for (int j = threadIdx.x; j < np * K; j += blockDim.x) {
                const int pr = s_pair[j / K], k = j % K, lt = pr / MAX_RANKS, r = pr % MAX_RANKS;
                const int tt = base + lt, sl = s_slot[lt * N + r];
                char *slot = (char *)dst_slot[r];
                int e = topk_at(topk, idx64, (long long)tt * K + k);
                int le = (e >= 0 && e < L.E_local * N && e / L.E_local == r) ? e % L.E_local : -1;
                ((int *)(slot + L.off_exp))[(long long)sl * K + k] = le;
                ((float *)(slot + L.off_wts))[(long long)sl * K + k] = weights[(long long)tt * K + k];
            }
            const int ca = L.seg_a >> 4, cb = L.seg_b >> 2, units = ca + cb;
            for (int j = threadIdx.x; j < np * units; j += blockDim.x) {
                const int pr = s_pair[j / units], c = j % units, lt = pr / MAX_RANKS, r = pr % MAX_RANKS;
                const int tt = base + lt, sl = s_slot[lt * N + r];
                if (r == L.me) {
                    if (c == 0) tok_of[sl] = tt;
                    continue;
                }
                char *row = (char *)dst_slot[r] + L.off_rows + (long long)sl * L.row_bytes;
                if (c < ca)
                    ((uint4 *)row)[c] = ((const uint4 *)(x + (long long)tt * x_stride))[c];
                else
                    ((u32 *)(row + L.seg_a))[c - ca] = ((const u32 *)(scales + (long long)tt * s_stride))[c - ca];
            }
            __syncthreads();
        }
    }
    if (last_block(&ctr[1]) && threadIdx.x == 0) {
        for (int r = 0; r < N; ++r)
            if ((nv_mask >> r) & 1) *(volatile int *)(dst_slot[r]) = s_carry[r];
        __threadfence_system();
        for (int r = 0; r < N; ++r)
            if ((nv_mask >> r) & 1) st_release_sys((u64 *)dst_flag[r], epoch);
        *(volatile u64 *)ep = epoch;
    }
    return epoch;
}

extern "C" __global__ void dispatch_send(
    const void *topk, int idx64, const float *weights, const char *x, long long x_stride,
    const char *scales, long long s_stride, int n_tok, const Layout *Lp, const u64 *tab,
    u64 *ep, u64 proxy_mask, u64 *watcher, int *slot_of, int *tok_of, u32 *ctr, u32 *err) {
    send_tokens(topk, idx64, weights, x, x_stride, scales, s_stride, n_tok, Lp, tab, ep,
                proxy_mask, watcher, slot_of, tok_of, ctr, err);
}

// ---------------------------------------------------------------- dispatch: receive

// Warp 0 alone (threads 0..31, together) turns the per-expert counts in shared cnt[0..E)
// into exclusive offsets, in place: each lane takes a contiguous run of experts, a shuffle
// scan over the lanes' sums gives each run its start. With `publish`, it also stores the
// counts and offsets for the caller (expert_counts, expert_offsets and the total at
// expert_offsets[E]; the offsets again in `cursor` unless it is null) and flags a total
// above `capacity` in `err`. The one scan of dispatch_route and receive_small.
__device__ __forceinline__ void scan_counts(int *cnt, int E, bool publish, int *expert_counts,
                                            int *expert_offsets, int *cursor, long long capacity,
                                            u32 *err) {
    const int lane = threadIdx.x, per = (E + 31) / 32, lo = min(E, lane * per), hi = min(E, lo + per);
    long long sum = 0;
    for (int e = lo; e < hi; ++e) sum += cnt[e];
    long long incl = sum;
    for (int d = 1; d < 32; d <<= 1) {
        const long long v = __shfl_up_sync(0xffffffffu, incl, d);
        if (lane >= d) incl += v;
    }
    long long acc = incl - sum;
    for (int e = lo; e < hi; ++e) {
        const int c = cnt[e];
        if (publish) {
            expert_counts[e] = c;
            expert_offsets[e] = (int)acc;
            if (cursor) cursor[e] = (int)acc;
        }
        cnt[e] = (int)acc;
        acc += c;
    }
    if (publish && lane == 31) {
        expert_offsets[E] = (int)incl;
        if (incl > capacity) atomicOr(err, ERR_CAPACITY);
    }
}

// Many blocks: wait for every source, count the received entries per local expert (shared
// histograms, added into gcount), and the last block lays the experts out one after
// another: counts, offsets, and cursor[e] = offset[e] for dispatch_copy (gcount is left
// zeroed for the next call). dynamic shared memory: E_local ints.
extern "C" __global__ void dispatch_route(
    const u64 *tab, const u64 *ep, const Layout *Lp, long long capacity, int *expert_counts,
    int *expert_offsets, int *gcount, int *cursor, int *ntok, u32 *ctr, u32 *err, u64 timeout_ns) {
    const Layout L = *Lp;
    const u64 epoch = ld_volatile(ep);
    const u64 *src_slot = table(tab, epoch, 2, L.N), *src_flag = table(tab, epoch, 3, L.N);
    extern __shared__ int s_cnt[];  // [E_local]
    __shared__ int s_n[MAX_RANKS];
    const int N = L.N, K = L.K, E = L.E_local;
    for (int r = threadIdx.x; r < N; r += blockDim.x) {
        wait_epoch((const u64 *)src_flag[r], epoch, timeout_ns, err);
        int n = *(volatile int *)(src_slot[r]);
        s_n[r] = (n >= 0 && n <= L.T) ? n : 0;
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) s_cnt[e] = 0;
    __syncthreads();
    long long total = 0;
    for (int r = 0; r < N; ++r) total += (long long)s_n[r] * K;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long j = (long long)blockIdx.x * blockDim.x + threadIdx.x; j < total; j += stride) {
        long long i = j;
        int r = 0;
        while (i >= (long long)s_n[r] * K) i -= (long long)s_n[r++] * K;
        const int e = __ldcg((const int *)((const char *)src_slot[r] + L.off_exp) + i);
        if (e >= 0 && e < E) atomicAdd(&s_cnt[e], 1);
    }
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += blockDim.x)
        if (s_cnt[e]) atomicAdd(&gcount[e], s_cnt[e]);
    __threadfence();
    if (!last_block(ctr)) return;
    // the totals, read (and reset) in parallel; then warp 0 scans them: each lane a
    // contiguous run of experts, a shuffle scan over the lanes' sums
    for (int e = threadIdx.x; e < E; e += blockDim.x) s_cnt[e] = atomicExch(&gcount[e], 0);
    for (int r = threadIdx.x; r < N; r += blockDim.x) ntok[r] = s_n[r];
    __syncthreads();
    if (threadIdx.x < 32) scan_counts(s_cnt, E, true, expert_counts, expert_offsets, cursor, capacity, err);
}

// One received row (source r, slot i) to its places s_p[0..K) in the expert-major output,
// by the whole block: each 16-byte piece (and scale word) is read once and stored at every
// place. Rows of this rank's own tokens are read from x and scales (tok_of), not from a
// staged copy.
__device__ __forceinline__ void copy_row(
    const Layout &L, int r, int i, const char *slot, const int *s_p, char *__restrict__ out_x,
    char *__restrict__ out_s, const char *x, long long x_stride, const char *scales,
    long long s_stride, const int *tok_of) {
    const int K = L.K, ca = L.seg_a >> 4, cb = L.seg_b >> 2;
    const char *xa, *sa;
    if (r == L.me) {
        const long long t = __ldcg(tok_of + i);  // dispatch_small wrote it in this launch
        xa = x + t * x_stride;
        sa = scales + t * s_stride;
    } else {
        xa = slot + L.off_rows + (long long)i * L.row_bytes;
        sa = xa + L.seg_a;
    }
    for (int c = threadIdx.x; c < ca + cb; c += blockDim.x) {
        if (c < ca) {
            const uint4 v = __ldcg((const uint4 *)xa + c);
            for (int k = 0; k < K; ++k) {
                const int p = s_p[k];
                if (p >= 0) ((uint4 *)(out_x + (long long)p * L.seg_a))[c] = v;
            }
        } else {
            const u32 v = __ldcg((const u32 *)sa + (c - ca));
            for (int k = 0; k < K; ++k) {
                const int p = s_p[k];
                if (p >= 0) ((u32 *)(out_s + (long long)p * L.seg_b))[c - ca] = v;
            }
        }
    }
}

// The row's first K threads take its places in its experts: base[e] plus a ticket from
// tick[e] (atomics: the order within an expert is not part of the contract), recorded for
// combine (pos, wts) and in s_p for copy_row.
__device__ __forceinline__ void take_places(
    const Layout &L, const char *slot, int i, long long e0, const int *base, int *tick,
    long long capacity, int *s_p, int *pos, float *wts) {
    const int K = L.K, E = L.E_local;
    if (threadIdx.x < K) {
        const int e = __ldcg((const int *)(slot + L.off_exp) + (long long)i * K + threadIdx.x);
        int p = -1;
        if (e >= 0 && e < E) {
            p = (base ? base[e] : 0) + atomicAdd(&tick[e], 1);
            if (p >= capacity) p = -1;  // reported through err (dispatch_route / _small)
        }
        s_p[threadIdx.x] = p;
        pos[e0 + threadIdx.x] = p;
        wts[e0 + threadIdx.x] = __ldcg((const float *)(slot + L.off_wts) + (long long)i * K + threadIdx.x);
    }
}

// After dispatch_route: one block per received row (grid-stride).
extern "C" __global__ void dispatch_copy(
    const u64 *tab, const u64 *ep, const int *ntok, int *cursor, const Layout *Lp,
    long long capacity, int *pos, float *wts, char *__restrict__ out_x, char *__restrict__ out_s,
    const char *x, long long x_stride, const char *scales, long long s_stride, const int *tok_of) {
    const Layout L = *Lp;
    const u64 *src_slot = table(tab, ld_volatile(ep), 2, L.N);
    __shared__ int s_p[32];
    const int N = L.N;
    int rows = 0;
    for (int r = 0; r < N; ++r) rows += ntok[r];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        int i = row, r = 0;
        while (i >= ntok[r]) i -= ntok[r++];
        const char *slot = (const char *)src_slot[r];
        take_places(L, slot, i, ((long long)r * L.T + i) * L.K, nullptr, cursor, capacity, s_p, pos, wts);
        __syncthreads();
        copy_row(L, r, i, slot, s_p, out_x, out_s, x, x_stride, scales, s_stride, tok_of);
        __syncthreads();
    }
}

// dispatch_route and dispatch_copy in one, for calls with few entries (decode):
// every block waits for the sources and counts every received entry itself (a few per
// thread), so each knows every expert's offset without a grid-wide step; places come from
// tickets in fill[parity] (block 0 clears the other parity's for the next call and writes
// counts, offsets and ntok). dynamic shared memory: E_local ints.
__device__ __forceinline__ void receive_small(
    u64 epoch, const u64 *tab, const Layout *Lp, long long capacity, int *expert_counts,
    int *expert_offsets, int *fill, int *ntok, u32 *err, u64 timeout_ns, int *pos, float *wts,
    char *__restrict__ out_x, char *__restrict__ out_s, const char *x, long long x_stride,
    const char *scales, long long s_stride, const int *tok_of) {
    const Layout L = *Lp;
    const u64 *src_slot = table(tab, epoch, 2, L.N), *src_flag = table(tab, epoch, 3, L.N);
    extern __shared__ int s_off[];  // [E_local]: counts, then offsets
    __shared__ int s_n[MAX_RANKS];
    __shared__ int s_p[32];
    const int N = L.N, K = L.K, E = L.E_local;
    const bool lead = blockIdx.x == 0;
    for (int r = threadIdx.x; r < N; r += blockDim.x) {
        wait_epoch((const u64 *)src_flag[r], epoch, timeout_ns, lead ? err : nullptr);
        int n = *(volatile int *)(src_slot[r]);
        s_n[r] = (n >= 0 && n <= L.T) ? n : 0;
    }
    for (int e = threadIdx.x; e < E; e += blockDim.x) s_off[e] = 0;
    int *tick = fill + (epoch & 1) * E;
    if (lead)
        for (int e = threadIdx.x; e < E; e += blockDim.x) fill[(1 - (epoch & 1)) * E + e] = 0;
    __syncthreads();
    for (int r = 0; r < N; ++r) {
        const int *ex = (const int *)((const char *)src_slot[r] + L.off_exp);
        const int n = s_n[r] * K;
        for (int j = threadIdx.x; j < n; j += blockDim.x) {
            const int e = __ldcg(ex + j);
            if (e >= 0 && e < E) atomicAdd(&s_off[e], 1);
        }
    }
    __syncthreads();
    if (threadIdx.x < 32) scan_counts(s_off, E, lead, expert_counts, expert_offsets, nullptr, capacity, err);
    if (lead)
        for (int r = threadIdx.x; r < N; r += blockDim.x) ntok[r] = s_n[r];
    __syncthreads();
    int rows = 0;
    for (int r = 0; r < N; ++r) rows += s_n[r];
    for (int row = blockIdx.x; row < rows; row += gridDim.x) {
        int i = row, r = 0;
        while (i >= s_n[r]) i -= s_n[r++];
        const char *slot = (const char *)src_slot[r];
        take_places(L, slot, i, ((long long)r * L.T + i) * K, s_off, tick, capacity, s_p, pos, wts);
        __syncthreads();
        copy_row(L, r, i, slot, s_p, out_x, out_s, x, x_stride, scales, s_stride, tok_of);
        __syncthreads();
    }
}

// A whole decode-sized dispatch in one launch (one host call instead of two, no gap
// between the kernels): every block sends its part, then receives. Blocks spin on the
// sources' flags, which need every block of every rank past its send part, so the grid
// must fit on the GPU at once (alltoall sizes it by occupancy). dynamic shared memory:
// the larger of send_tokens' and receive_small's.
extern "C" __global__ void dispatch_small(
    const void *topk, int idx64, const float *weights, const char *x, long long x_stride,
    const char *scales, long long s_stride, int n_tok, const Layout *Lp, const u64 *tab,
    u64 *ep, u64 proxy_mask, u64 *watcher, int *slot_of, int *tok_of, u32 *ctr, u32 *err,
    long long capacity, int *expert_counts, int *expert_offsets, int *fill, int *ntok,
    u64 timeout_ns, int *pos, float *wts, char *__restrict__ out_x, char *__restrict__ out_s) {
    const u64 epoch = send_tokens(topk, idx64, weights, x, x_stride, scales, s_stride, n_tok, Lp, tab, ep,
                proxy_mask, watcher, slot_of, tok_of, ctr, err);
    __syncthreads();  // the dynamic shared memory changes hands
    receive_small(epoch, tab, Lp, capacity, expert_counts, expert_offsets, fill, ntok, err,
                  timeout_ns, pos, wts, out_x, out_s, x, x_stride, scales, s_stride, tok_of);
}

// ---------------------------------------------------------------- combine

// Expert side: one warp per received (source, slot) sums weight * expert output over the
// entry's local experts (fp32) and stores that partial into the source's combine slot for
// this rank (NVLink) or this rank's send region for the source (proxy). Proxy-bound
// partials first, then the watcher bump, then NVLink stores; the last block publishes
// epochs.
extern "C" __global__ void combine_send(
    const out_t *__restrict__ expert_out, const int *pos, const float *wts, const int *ntok, int H,
    const Layout *Lp, const u64 *tab, u64 *ep, u64 proxy_mask, u64 *watcher, u32 *ctr) {
    const Layout L = *Lp;
    const u64 epoch = ld_volatile(ep + 1) + 1;  // every block reads it before last_block below
    const u64 *dst_slot = table(tab, epoch, 4, L.N), *dst_flag = table(tab, epoch, 5, L.N);
    const int N = L.N, K = L.K;
    const u64 all = (N >= 64) ? ~0ull : ((1ull << N) - 1);
    const int chunks = H / OUT_PER_U4;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (int pass = 0; pass < 2; ++pass) {
        const u64 want = pass == 0 ? proxy_mask : (all & ~proxy_mask);
        if (pass == 1 && proxy_mask) {
            if (last_block(&ctr[0]) && threadIdx.x == 0) {
                __threadfence_system();
                *(volatile u64 *)watcher = epoch;
            }
        }
        if (want == 0) continue;
        long long total = 0;
        for (int r = 0; r < N; ++r)
            if ((want >> r) & 1) total += ntok[r];
        total *= chunks;
        for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += stride) {
            int i = (int)(u / chunks), r = 0;
            const int c = (int)(u % chunks);
            for (;;) {
                if ((want >> r) & 1) {
                    if (i < ntok[r]) break;
                    i -= ntok[r];
                }
                ++r;
            }
            const long long e0 = ((long long)r * L.T + i) * K;
            float acc[OUT_PER_U4];
#pragma unroll
            for (int j = 0; j < OUT_PER_U4; ++j) acc[j] = 0.f;
#pragma unroll 4
            for (int k = 0; k < K; ++k) {
                const int p = pos[e0 + k];
                if (p < 0) continue;
                const float w = wts[e0 + k];
                const uint4 v = __ldg((const uint4 *)(expert_out + (long long)p * H) + c);
                const out_t *e = (const out_t *)&v;
#pragma unroll
                for (int j = 0; j < OUT_PER_U4; ++j) acc[j] += w * out_to_f(e[j]);
            }
            uint4 o;
            out_t *oe = (out_t *)&o;
#pragma unroll
            for (int j = 0; j < OUT_PER_U4; ++j) oe[j] = f_to_out(acc[j]);
            ((uint4 *)((out_t *)dst_slot[r] + (long long)i * H))[c] = o;
        }
    }
    if (last_block(&ctr[1]) && threadIdx.x == 0) {
        for (int r = 0; r < N; ++r)
            if (!((proxy_mask >> r) & 1)) st_release_sys((u64 *)dst_flag[r], epoch);
        *(volatile u64 *)(ep + 1) = epoch;
    }
}

// Source side: wait for every expert rank, then one warp per token sums its partials.
extern "C" __global__ void combine_recv(
    const u64 *tab, const u64 *ep, const int *slot_of, int n_tok, int H, const Layout *Lp,
    out_t *__restrict__ out, u32 *err, u64 timeout_ns) {
    const Layout L = *Lp;
    const u64 epoch = ld_volatile(ep + 1);
    const u64 *src_slot = table(tab, epoch, 6, L.N), *src_flag = table(tab, epoch, 7, L.N);
    const int N = L.N;
    for (int r = threadIdx.x; r < N; r += blockDim.x)
        wait_epoch((const u64 *)src_flag[r], epoch, timeout_ns, err);
    __syncthreads();
    const int chunks = H / OUT_PER_U4;
    const long long total = (long long)n_tok * chunks;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long u = (long long)blockIdx.x * blockDim.x + threadIdx.x; u < total; u += stride) {
        const long long t = u / chunks;
        const int c = (int)(u % chunks);
        float acc[OUT_PER_U4];
#pragma unroll
        for (int j = 0; j < OUT_PER_U4; ++j) acc[j] = 0.f;
        for (int r = 0; r < N; ++r) {
            const int s = slot_of[t * N + r];
            if (s < 0) continue;
            const uint4 v = __ldcg((const uint4 *)((const out_t *)src_slot[r] + (long long)s * H) + c);
            const out_t *e = (const out_t *)&v;
#pragma unroll
            for (int j = 0; j < OUT_PER_U4; ++j) acc[j] += out_to_f(e[j]);
        }
        uint4 o;
        out_t *oe = (out_t *)&o;
#pragma unroll
        for (int j = 0; j < OUT_PER_U4; ++j) oe[j] = f_to_out(acc[j]);
        ((uint4 *)(out + t * H))[c] = o;
    }
}
