"""NIXL's Python API over afabric: ``nixl_agent`` and the names of NIXL's modules.

``afabric.compat.nixl._api``, ``._bindings``, ``._utils`` and ``.logging`` are what the
alias distribution in ``compat/nixl`` installs as ``nixl._api``, ``nixl._bindings``,
``nixl._utils`` and ``nixl.logging``, so code written for NIXL (vLLM's NIXL connector,
Dynamo, SGLang) runs unchanged. Importing starts no thread and loads no library: the first
agent's UCX/LIBFABRIC backend opens its endpoint. Behaviour and limits: docs/compat/nixl.md.
"""

from ._api import (
    DEFAULT_COMM_PORT,
    nixl_agent,
    nixl_agent_config,
    nixl_backend_handle,
    nixl_prepped_dlist_handle,
    nixl_thread_sync_t,
    nixl_xfer_handle,
)

__all__ = [
    "DEFAULT_COMM_PORT",
    "nixl_agent",
    "nixl_agent_config",
    "nixl_backend_handle",
    "nixl_prepped_dlist_handle",
    "nixl_thread_sync_t",
    "nixl_xfer_handle",
]
