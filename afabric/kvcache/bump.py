"""Signalling "layer done" to the shim: one step of the prefiller's watcher.

On the host the compute thread adds 1 to the watcher word itself, right after the layer's
output is in memory. On a GPU the add is a one-thread kernel queued on the stream that
computes the layers (torch's current stream of that device, in the calling thread), so it
runs right after the layer's kernels, with no Python between: the layer's KV is visible
system-wide before the word changes (``__threadfence_system``), and the shim posts the
layer's writes the moment its watcher thread sees the change. CuPy compiles the kernel on
first use (NVRTC), once per device.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

from ..watcher import UvmWatcher

_SOURCE = r"""
extern "C" __global__ void afabric_kv_bump(unsigned long long *word)
{
    __threadfence_system();   /* the layer's stores are visible before the signal */
    atomicAdd(word, 1ULL);
    __threadfence_system();   /* and the signal leaves for host memory now */
}
"""

_KERNELS: dict[int, Any] = {}
_LOCK = threading.Lock()


def _kernel(device: int) -> Any:
    with _LOCK:
        k = _KERNELS.get(device)
        if k is None:
            cp = importlib.import_module("cupy")
            with cp.cuda.Device(device):
                k = cp.RawModule(code=_SOURCE).get_function("afabric_kv_bump")
            _KERNELS[device] = k
        return k


class Bumper:
    """Adds 1 to a watcher word: from the calling thread (host watcher) or by a kernel on
    the calling thread's current torch stream of the watcher's device (CUDA watcher)."""

    def __init__(self, watcher: UvmWatcher) -> None:
        self.watcher = watcher
        self.device = watcher.device
        if self.device >= 0:
            _kernel(self.device)  # compile now, not inside the first layer

    def __call__(self) -> None:
        if self.device < 0:
            self.watcher.add(1)
            return
        import torch

        cp = importlib.import_module("cupy")
        stream = torch.cuda.current_stream(self.device).cuda_stream
        with cp.cuda.Device(self.device), cp.cuda.ExternalStream(stream):
            _kernel(self.device)((1,), (1,), (cp.uint64(self.watcher.device_ptr),))
