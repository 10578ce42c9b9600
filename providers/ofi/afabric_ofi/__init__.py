"""afabric's first-party libfabric provider plugin: ``efa``, ``tcp`` and ``shm``.

Shipped and discovered exactly like a third-party plugin: this distribution declares
entry points in the group ``afabric.providers`` and each points at one of the functions
below, which return a :class:`afabric.provider.ProviderSpec` naming the native library
``libafabric_ofi.so`` installed next to this file. Nothing native is loaded here.

Environment:

- ``AFABRIC_OFI_LIB``: use this provider library instead of the packaged one (e.g. a
  sanitizer build from ``python build_native.py --sanitize --out DIR``).
- ``AFABRIC_TCP_BIND``: interface address tcp binds by default (``127.0.0.1`` otherwise);
  ``Engine(bind=...)`` overrides it per engine.
"""

from __future__ import annotations

import os

from afabric.provider import PROVIDER_ABI_MAJOR, ProviderSpec, plugin_library

__all__ = ["LIBRARY_NAME", "efa", "library_path", "shm", "tcp"]

LIBRARY_NAME = "libafabric_ofi.so"

_LIBFABRIC_HINT = "apt-get install libfabric1 (or point LD_LIBRARY_PATH at another libfabric)"


def library_path() -> str:
    """Absolute path of the libfabric provider library (``$AFABRIC_OFI_LIB`` overrides it)."""
    return plugin_library(__file__, LIBRARY_NAME, "AFABRIC_OFI_LIB")


def efa() -> ProviderSpec:
    """AWS EFA through libfabric (SRD): the only hardware path of this plugin."""
    return ProviderSpec(
        name="efa",
        library=library_path(),
        fabric_provider="efa",
        priority=100,
        abi_major=PROVIDER_ABI_MAJOR,
        hint="needs an AWS EFA device and the EFA libfabric (/opt/amazon/efa)",
        description="AWS Elastic Fabric Adapter (libfabric efa, SRD)",
    )


def tcp() -> ProviderSpec:
    """libfabric's tcp provider: works between hosts without RDMA hardware.

    Binds loopback by default: with no address libfabric's tcp picks eth0 first, and a
    test or single-host run must not depend on the machine's network.
    """
    bind = os.environ.get("AFABRIC_TCP_BIND") or "127.0.0.1"
    return ProviderSpec(
        name="tcp",
        library=library_path(),
        fabric_provider="tcp",
        priority=10,
        abi_major=PROVIDER_ABI_MAJOR,
        bind_addr=bind,
        hint=_LIBFABRIC_HINT,
        description="libfabric tcp (software; any host, over TCP sockets)",
        options={"bind": bind},
    )


def shm() -> ProviderSpec:
    """libfabric's shm provider: shared memory, within one host only.

    Reach "host", ranked below cma: a default engine opens it for its own host's processes
    only where cma is unavailable (ptrace scope, seccomp); ``Engine("shm")`` uses it alone.
    """
    return ProviderSpec(
        name="shm",
        library=library_path(),
        fabric_provider="shm",
        priority=5,
        reach="host",
        abi_major=PROVIDER_ABI_MAJOR,
        hint=_LIBFABRIC_HINT,
        description="libfabric shm (shared memory; processes on one host only)",
    )
