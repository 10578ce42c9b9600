"""afabric provider plugin offering libfabric's ``sockets`` provider.

An example for plugin authors (see README.md): a zero-argument function, named by an
entry point in the group ``afabric.providers``, returning a ProviderSpec. This plugin
reuses the first-party libfabric provider library instead of shipping its own.
``sockets`` is slower than ``tcp`` and deprecated upstream, so its priority is 0:
``provider="auto"`` never picks it; ask for ``Engine(provider="sockets")``.
"""

from __future__ import annotations

import os

import afabric_ofi
from afabric.provider import PROVIDER_ABI_MAJOR, ProviderSpec

__all__ = ["sockets"]


def sockets() -> ProviderSpec:
    """The spec afabric loads for ``provider="sockets"``; cheap, loads nothing native."""
    # Like tcp, bind loopback unless told otherwise: with no address libfabric picks the
    # first interface (eth0), which single-host runs must not depend on.
    bind = os.environ.get("AFABRIC_SOCKETS_BIND") or "127.0.0.1"
    return ProviderSpec(
        name="sockets",
        library=afabric_ofi.library_path(),
        fabric_provider="sockets",
        priority=0,
        abi_major=PROVIDER_ABI_MAJOR,
        bind_addr=bind,
        hint="libfabric's sockets provider: apt-get install libfabric1 (some builds leave it out)",
        description="libfabric sockets (software reference provider; example third-party plugin)",
        options={"bind": bind},
    )
