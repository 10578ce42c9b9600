"""afabric's first-party cross-memory-attach provider plugin: ``cma`` (host memory within a node).

Shipped and discovered exactly like a third-party plugin: this distribution declares the
entry point ``cma`` in the group ``afabric.providers``, pointing at :func:`cma`, which returns
a :class:`afabric.provider.ProviderSpec` naming the native library ``libafabric_cma.so``
installed next to this file. Nothing native is loaded here.

What it moves: host memory into host memory of any process (or engine) on the same node.
The writer copies into the target itself with ``process_vm_writev(2)`` (reads:
``process_vm_readv``); only immediates go through the target's shared-memory mailbox, so
the target's worker is not on the data's path. Never picked by ``provider="auto"``: ask
for it by name.

Environment:

- ``AFABRIC_CMA_LIB``: use this provider library instead of the packaged one.
"""

from __future__ import annotations

from afabric.provider import PROVIDER_ABI_MAJOR, ProviderSpec, plugin_library

__all__ = ["LIBRARY_NAME", "cma", "library_path"]

LIBRARY_NAME = "libafabric_cma.so"


def library_path() -> str:
    """Absolute path of the cma provider library (``$AFABRIC_CMA_LIB`` overrides it)."""
    return plugin_library(__file__, LIBRARY_NAME, "AFABRIC_CMA_LIB")


def cma() -> ProviderSpec:
    """Cross-memory attach between the processes of one node: the writer copies.

    Reach "host": a default engine opens it beside its network provider and writes to the
    processes of its own host through it (host memory); ``Engine("cma")`` uses it alone.
    """
    return ProviderSpec(
        name="cma",
        library=library_path(),
        fabric_provider="cma",
        priority=50,
        reach="host",
        abi_major=PROVIDER_ABI_MAJOR,
        hint="needs process_vm_writev between the processes: same uid, dumpable processes, "
        "Yama ptrace_scope 0 or 1 (2 with CAP_SYS_PTRACE), a seccomp profile that allows it",
        description="cross-memory attach between the processes of one node (host memory)",
    )
