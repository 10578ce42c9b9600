"""``nixl``: NIXL's import names over afabric (``afabric.compat.nixl``).

``nixl._api``, ``nixl._bindings``, ``nixl._utils`` and ``nixl.logging`` are afabric's
modules themselves (not copies), registered under these names, so a name replaced in one
(as tests do with ``nixl._bindings.nixlAgent``) is replaced for both.
"""

import importlib
import sys

for _sub in ("_api", "_bindings", "_utils", "logging"):
    _mod = importlib.import_module(f"afabric.compat.nixl.{_sub}")
    sys.modules[f"{__name__}.{_sub}"] = _mod
    globals()[_sub] = _mod

from afabric.compat.nixl import (  # noqa: E402 - after the aliases, as they must be
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
