"""Compiles kernels.cu with CuPy (NVRTC) once per device and output dtype, and launches it.

CuPy is imported here, lazily, so importing afabric.moe needs no GPU.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np

from .config import MoeConfig, SlotLayout

_SRC = Path(__file__).with_name("kernels.cu")
KERNELS = ("dispatch_send", "dispatch_route", "dispatch_copy", "combine_send", "combine_recv")
ERR_CAPACITY = 1
ERR_EXPERT = 2
ERR_TIMEOUT = 4
# Threads per block. dispatch_route is one block that walks every received entry.
SEND_THREADS = 512
ROUTE_THREADS = 1024
COPY_THREADS = 256


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
    """The five kernels for one configuration on one device."""

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
        self.route_smem = 2 * cfg.experts_per_rank * 4
        if self.route_smem > 40 * 1024:
            from ..errors import InvalidArgument

            raise InvalidArgument(f"{cfg.experts_per_rank} experts per rank: at most 5120 are supported")
        import cupy

        self._cupy = cupy
        self._streams: dict[int, Any] = {}
        self.sms = int(cupy.cuda.runtime.deviceGetAttribute(16, device))  # cudaDevAttrMultiProcessorCount

    def stream(self, handle: int) -> Any:
        """A CuPy view of a CUDA stream (torch's current one), cached by handle."""
        s = self._streams.get(handle)
        if s is None:
            s = self._cupy.cuda.ExternalStream(handle, self.device)
            self._streams[handle] = s
        return s

    def copy_blocks(self, threads: int) -> int:
        """Blocks of COPY_THREADS for a grid-stride loop over ``threads`` work items: enough
        to fill every SM several times over, never more than the work."""
        return max(1, min(self.sms * 8, -(-threads // COPY_THREADS)))
