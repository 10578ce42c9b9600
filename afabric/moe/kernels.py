"""Compiles kernels.cu with CuPy (NVRTC) once per device and output dtype, and launches it.

Launches go straight to the driver (``cuLaunchKernel`` through CuPy) with argument blocks
built once per kernel: a call rewrites only the words that change, so the host cost of a
dispatch or combine is a few microseconds, not CuPy's per-argument conversion.
CuPy is imported here, lazily, so importing afabric.moe needs no GPU.
"""

from __future__ import annotations

import functools
import re
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


_KERNEL = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)')
_PARAM_NAME = re.compile(r"(\w+)\s*$")


@functools.cache
def kernel_params() -> dict[str, tuple[str, ...]]:
    """Every ``extern "C" __global__`` kernel of kernels.cu: its parameters' names in
    signature order, read from the source, so arguments are set by those names."""
    out: dict[str, tuple[str, ...]] = {}
    for m in _KERNEL.finditer(_SRC.read_text()):
        names = []
        for decl in m.group(2).split(","):
            found = _PARAM_NAME.search(decl.strip())
            if found is None:
                raise RuntimeError(f"kernels.cu: cannot read a parameter name of {m.group(1)} in {decl!r}")
            names.append(found.group(1))
        out[m.group(1)] = tuple(names)
    return out


class Args:
    """A kernel's argument block: one 8-byte word per parameter (pointers, 64-bit values,
    and non-negative 32-bit ones in the low half), addressed by the parameters' names in
    kernels.cu. No CUDA needed (the tests check the names without a GPU)."""

    def __init__(self, kernel: str, params: tuple[str, ...]) -> None:
        self.kernel, self.names = kernel, params
        self._index = {name: i for i, name in enumerate(params)}
        self.words = np.zeros(len(params), dtype=np.uint64)
        self.call_words = slice(0, 0)
        """The words each call rewrites (the caller's choice, from :meth:`span`)."""

    def set(self, **values: int) -> None:
        """Every argument at once, by name (setup); a missing or unknown name is an error.
        Calls then rewrite single words (:meth:`at`, :meth:`span`)."""
        missing = [n for n in self.names if n not in values]
        unknown = sorted(set(values) - set(self.names))
        if missing or unknown:
            raise ValueError(f"{self.kernel} arguments: missing {missing}, unknown {unknown}")
        self.words[:] = [values[n] for n in self.names]

    def at(self, name: str) -> int:
        """The word of parameter ``name``."""
        return self._index[name]

    def span(self, first: str, last: str) -> slice:
        """The words of parameters ``first`` to ``last`` (in signature order), which a call
        rewrites at once: ``words[span] = (...)``."""
        return slice(self._index[first], self._index[last] + 1)


class Launch(Args):
    """One kernel with a persistent argument block: ``kernelParams`` points at the words,
    so a launch is one driver call."""

    def __init__(self, fn: Any, kernel: str, block: int, smem: int = 0) -> None:
        from cupy.cuda import driver

        super().__init__(kernel, kernel_params()[kernel])
        self._launch = driver.launchKernel
        self.f = int(fn.kernel.ptr)  # the CUfunction on the current device (compiles once)
        self.block, self.smem = block, smem
        base = int(self.words.ctypes.data)
        nargs = len(self.names)
        self._ptrs = np.arange(nargs, dtype=np.uint64) * np.uint64(8) + np.uint64(base)
        self.params = int(self._ptrs.ctypes.data)

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
