"""MoE dispatch/combine: tokens to their top-k experts and the experts' outputs back.

``AllToAll`` moves tokens with CuPy raw kernels, over NVLink (CUDA IPC) between ranks of
one node and through a host proxy (triggered operations in the shim) between nodes.
Importing this package needs neither CUDA nor CuPy; constructing an ``AllToAll`` does.
"""

from .alltoall import AllGather, AllToAll, DispatchResult, torch_all_gather
from .config import BufferSizes, MoeConfig, buffer_sizes
from .control import ControlMessageError, PeerInfo

__all__ = [
    "AllGather",
    "AllToAll",
    "BufferSizes",
    "ControlMessageError",
    "DispatchResult",
    "MoeConfig",
    "PeerInfo",
    "buffer_sizes",
    "torch_all_gather",
]
