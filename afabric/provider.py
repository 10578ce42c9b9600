"""What a provider plugin declares: the public contract for plugin authors.

A plugin is a distribution with an entry point in the group ``afabric.providers`` whose
object is a zero-argument callable returning a :class:`ProviderSpec`:

    [project.entry-points."afabric.providers"]
    sockets = "afabric_sockets:sockets"

The spec names a native library exporting ``afp_get_ops`` (the C table of
``shim/afabric_provider.h``); afabric loads it only when the provider is used.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

PROVIDER_ABI_MAJOR = 1


@dataclass(frozen=True)
class ProviderSpec:
    """A provider as afabric sees it before loading anything native."""

    name: str
    """afabric's name for it: ``Engine(provider=name)``."""
    library: str
    """Absolute path of the native library implementing the provider ABI."""
    fabric_provider: str
    """Name the native library is given (libfabric's provider name: "tcp", "shm", "efa")."""
    priority: int = 0
    """Order for ``provider="auto"`` among providers of the same reach: the highest available
    one of each reach is opened; 0 = never opened by auto."""
    reach: str = "network"
    """What it can reach: ``"host"`` (processes of this host: same kernel boot and PID
    namespace), ``"node"`` (GPUs of this node) or ``"network"`` (any host). A default engine
    opens the best available provider of each and prefers the narrowest that reaches a peer."""
    abi_major: int = PROVIDER_ABI_MAJOR
    """Provider ABI major version the library was built for."""
    bind_addr: str | None = None
    """Interface address bound by default (tcp binds loopback unless told otherwise)."""
    hint: str = ""
    """Shown when the provider is unavailable ("install libfabric1", "no EFA device")."""
    description: str = ""
    options: dict[str, str] = field(default_factory=dict)
    """Free-form, provider-specific settings, shown by `afabric info`."""


def plugin_library(package_file: str, name: str, env: str) -> str:
    """Absolute path of a plugin's native library: ``name`` next to the package whose
    ``__file__`` is given, unless ``$env`` names another build (a sanitizer build, say)."""
    override = os.environ.get(env)
    if override:
        return str(Path(override).resolve())
    return str(Path(package_file).resolve().parent / name)
