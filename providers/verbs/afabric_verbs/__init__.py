"""afabric's first-party libibverbs provider plugin: ``verbs`` (ConnectX; Soft-RoCE in CI).

Shipped and discovered exactly like a third-party plugin: this distribution declares the
entry point ``verbs`` in the group ``afabric.providers``, pointing at :func:`verbs`, which
returns a :class:`afabric.provider.ProviderSpec` naming the native library
``libafabric_verbs.so`` installed next to this file. Nothing native is loaded here; the
library loads libibverbs itself when first used, so the same install works on machines
without rdma-core (the provider is then unavailable, with a hint).

Environment (read by the native library when an engine opens a NIC):

- ``AFABRIC_VERBS_LIB``: use this provider library instead of the packaged one.
- ``AFABRIC_LIBIBVERBS``: load this libibverbs instead of ``libibverbs.so.1``.
- ``AFABRIC_VERBS_GID_INDEX``: use this GID index instead of choosing from the GID table
  (RoCE v2 with an IPv4-mapped address first, then any RoCE v2 entry, then any other).
- ``AFABRIC_VERBS_CONNECT_TIMEOUT_MS``: how long operations wait for a peer to answer the
  connection handshake before failing with :class:`afabric.errors.OperationTimeout`
  (default 5000).
- ``AFABRIC_VERBS_IMM_DEPTH``: receives kept posted for immediates (default 4096).
- ``AFABRIC_VERBS_TEST_DROP_HELLOS``: test switch, drop the first N handshake datagrams
  that arrive (so that retransmission has to work).
"""

from __future__ import annotations

from afabric.provider import PROVIDER_ABI_MAJOR, ProviderSpec, plugin_library

__all__ = ["LIBRARY_NAME", "library_path", "verbs"]

LIBRARY_NAME = "libafabric_verbs.so"


def library_path() -> str:
    """Absolute path of the verbs provider library (``$AFABRIC_VERBS_LIB`` overrides it)."""
    return plugin_library(__file__, LIBRARY_NAME, "AFABRIC_VERBS_LIB")


def verbs() -> ProviderSpec:
    """RDMA over libibverbs, reliable connected queue pairs: ConnectX (InfiniBand/RoCE)."""
    return ProviderSpec(
        name="verbs",
        library=library_path(),
        fabric_provider="verbs",
        priority=90,
        abi_major=PROVIDER_ABI_MAJOR,
        hint="needs an RDMA device with an active port and libibverbs (apt-get install "
        "ibverbs-providers); `ibv_devinfo` lists what the machine has",
        description="libibverbs RC (ConnectX InfiniBand/RoCE; Soft-RoCE rxe)",
    )
