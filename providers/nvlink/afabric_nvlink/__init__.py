"""afabric's first-party CUDA IPC provider plugin: ``nvlink`` (GPU to GPU within a node).

Shipped and discovered exactly like a third-party plugin: this distribution declares the
entry point ``nvlink`` in the group ``afabric.providers``, pointing at :func:`nvlink`, which
returns a :class:`afabric.provider.ProviderSpec` naming the native library
``libafabric_nvlink.so`` installed next to this file. Nothing native is loaded here; the
library loads the CUDA driver (libcuda.so.1) itself when first used, so the same install
works on machines without CUDA (the provider is then unavailable, and says why).

What it moves: CUDA device memory into CUDA device memory of any process (or engine) on
the same node, over NVLink (or PCIe peer-to-peer). Regions are exported with CUDA IPC
handles (memory from cudaMalloc: torch's caching allocator, CuPy's pool); host memory can
be a source, never a target. Never picked by ``provider="auto"``: ask for it by name.

Environment:

- ``AFABRIC_NVLINK_LIB``: use this provider library instead of the packaged one.
"""

from __future__ import annotations

from afabric.provider import PROVIDER_ABI_MAJOR, ProviderSpec, plugin_library

__all__ = ["LIBRARY_NAME", "library_path", "nvlink"]

LIBRARY_NAME = "libafabric_nvlink.so"


def library_path() -> str:
    """Absolute path of the nvlink provider library (``$AFABRIC_NVLINK_LIB`` overrides it)."""
    return plugin_library(__file__, LIBRARY_NAME, "AFABRIC_NVLINK_LIB")


def nvlink() -> ProviderSpec:
    """CUDA IPC between processes of one node, on one GPU or between GPUs with peer access:
    writes are GPU copies (over NVLink between GPUs).

    Reach "node": a default engine opens it where a GPU is, and writes CUDA memory of the
    processes of its node through it; ``Engine("nvlink")`` uses it alone.
    """
    return ProviderSpec(
        name="nvlink",
        library=library_path(),
        fabric_provider="nvlink",
        priority=50,
        reach="node",
        abi_major=PROVIDER_ABI_MAJOR,
        hint="needs a CUDA GPU (peers on another GPU need peer access to it: NVLink or PCIe "
        "P2P) and the CUDA driver (libcuda.so.1, 12.0 or newer)",
        description="CUDA IPC within a GPU or between the GPUs of one node (NVLink / PCIe peer-to-peer)",
    )
