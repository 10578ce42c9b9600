"""Compiles kernels.cu with CuPy (NVRTC) once per device and output dtype, and launches it.

Launches go straight to the driver (``cuLaunchKernel`` through CuPy) with argument blocks
built once per kernel: a call rewrites only the words that change, so the host cost of a
dispatch or combine is a few microseconds, not CuPy's per-argument conversion.
CuPy is imported here, lazily, so importing afabric.moe needs no GPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from .config import MoeConfig, SlotLayout

_SRC = Path(__file__).with_name("kernels.cu")
KERNELS = (
    "dispatch_send", "dispatch_route", "dispatch_copy", "dispatch_small", "combine_send", "combine_recv",
)  # fmt: skip
ERR_CAPACITY = 1
ERR_EXPERT = 2
ERR_TIMEOUT = 4
# Threads per block.
SEND_THREADS = 512
ROUTE_THREADS = 512
COPY_THREADS = 256


class Launch:
    """One kernel with a persistent argument block: every argument occupies an 8-byte word
    (pointers, 64-bit values, and non-negative 32-bit ones in the low half), and
    ``kernelParams`` points at the words, so a launch is one driver call."""

    def __init__(self, fn: Any, nargs: int, block: int, smem: int = 0) -> None:
        from cupy.cuda import driver

        self._launch = driver.launchKernel
        self.f = int(fn.kernel.ptr)  # the CUfunction on the current device (compiles once)
        self.block, self.smem = block, smem
        self.words = np.zeros(nargs, dtype=np.uint64)
        base = int(self.words.ctypes.data)
        self._ptrs = np.arange(nargs, dtype=np.uint64) * np.uint64(8) + np.uint64(base)
        self.params = int(self._ptrs.ctypes.data)

    def set(self, *values: int) -> None:
        """All arguments at once (setup); calls then rewrite single ``words``."""
        self.words[:] = values

    def __call__(self, grid: int, stream: int) -> None:
        self._launch(self.f, grid, 1, 1, self.block, 1, 1, self.smem, stream, self.params, 0)


def layout_words(cfg: MoeConfig, rank: int, lay: SlotLayout) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The kernels' ``struct Layout`` as bytes: 5 int64 then 7 int32 (padded to 72)."""
    buf = np.zeros(72, dtype=np.uint8)
    buf[:40].view(np.int64)[:] = (
        lay.off_experts,
        lay.off_weights,
        lay.off_rows,
        lay.slot_bytes,
        lay.row_bytes,
    )
    buf[40:68].view(np.int32)[:] = (
        lay.seg_x, lay.seg_scales, cfg.max_tokens, cfg.experts_per_token,
        cfg.experts_per_rank, cfg.world_size, rank,
    )  # fmt: skip
    return buf


@functools.cache
def _module(device: int, out_fp32: bool) -> dict[str, Any]:
    import cupy

    with cupy.cuda.Device(device):
        mod = cupy.RawModule(
            code=_SRC.read_text(),
            options=("--std=c++14", f"-DOUT_FP32={int(out_fp32)}"),
        )
        return {name: mod.get_function(name) for name in KERNELS}


class Kernels:
    """The kernels for one configuration on one device."""

    def __init__(self, cfg: MoeConfig, device: int) -> None:
        self.cfg = cfg
        self.device = device
        self.fn = _module(device, cfg.out_dtype == "fp32")
        n = cfg.world_size
        # dispatch_send keeps a chunk's slots and owned pairs for every rank in shared memory
        threads = SEND_THREADS
        while threads > 64 and 2 * threads * n * 4 > 40 * 1024:
            threads //= 2
        self.send_threads = threads
        self.send_smem = 2 * threads * n * 4
        self.route_smem = cfg.experts_per_rank * 4
        if self.route_smem > 40 * 1024:
            from ..errors import InvalidArgument

            raise InvalidArgument(f"{cfg.experts_per_rank} experts per rank: at most 10240 are supported")
        # dispatch_small sends and receives in one launch: one block size for both parts
        self.small_threads = min(threads, COPY_THREADS)
        self.small_smem = max(2 * self.small_threads * n * 4, self.route_smem)
        import cupy

        self.sms = int(cupy.cuda.runtime.deviceGetAttribute(16, device))  # cudaDevAttrMultiProcessorCount
        occupancy = getattr(cupy.cuda.driver, "occupancyMaxActiveBlocksPerMultiprocessor", None)
        with cupy.cuda.Device(device):
            per_sm = 1
            if occupancy is not None:
                f = int(self.fn["dispatch_small"].kernel.ptr)
                try:
                    per_sm = max(1, int(occupancy(f, self.small_threads, self.small_smem)))
                except (TypeError, RuntimeError):  # CUDADriverError is a RuntimeError
                    per_sm = 1  # one block per SM always fits
        # blocks of dispatch_small that fit on the GPU at once (its blocks wait on each other)
        self.small_resident = self.sms * per_sm

    def copy_blocks(self, threads: int) -> int:
        """Blocks of COPY_THREADS for a grid-stride loop over ``threads`` work items: enough
        to fill every SM several times over, never more than the work."""
        return max(1, min(self.sms * 8, -(-threads // COPY_THREADS)))
