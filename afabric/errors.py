"""Typed errors. Misuse errors are apart from transport errors; builtins are mixed in
where the meaning matches, so generic handlers (`except ValueError`, `except TimeoutError`)
work too.

Error codes crossing the C boundary come from the shim's one table (afabric_shim.h,
read at load time through ``afs_error_info``); :func:`from_code` maps its names to the
classes here, and an unknown code still gives an :class:`AfabricError` keeping the value.
"""

from __future__ import annotations


class AfabricError(Exception):
    """Root of every afabric error."""

    code: int | None = None
    code_name: str | None = None
    operation: str = ""
    provider: str = ""


# ---- misuse ----


class UsageError(AfabricError):
    """The call itself was wrong; nothing was posted."""


class InvalidArgument(UsageError, ValueError):
    """A bad argument (type or value)."""


class InvalidType(InvalidArgument, TypeError):
    """An argument of the wrong type (e.g. ``str`` where bytes are needed)."""


class OutOfRange(InvalidArgument):
    """Offset or length outside a memory region; nothing was posted."""


class ImmediateOutOfRange(InvalidArgument):
    """Immediate values are 32-bit: 0..2**32-1."""


class EngineClosed(UsageError):
    """The engine (or the object derived from it) is closed."""


class StaleRegion(UsageError):
    """The memory region was deregistered, or belongs to another engine."""


class BadDescriptor(InvalidArgument):
    """A descriptor or address blob that is malformed, truncated or corrupted."""


class WrongProvider(InvalidArgument):
    """A descriptor or address from an engine using another provider."""


class MessageTooLarge(InvalidArgument):
    """A SEND larger than the engine's maximum message size."""


class Busy(UsageError):
    """The resource is in use (e.g. an expectation on the same immediate is pending)."""


# ---- environment ----


class ShimLoadError(AfabricError, ImportError):
    """The C shim could not be found or loaded."""


class ProviderUnavailable(AfabricError, LookupError):
    """The asked-for provider is not installed or sees no usable NIC."""


class PluginError(AfabricError):
    """A provider plugin is broken (bad entry point, wrong ABI, duplicate name)."""


class RegistrationError(AfabricError):
    """Memory could not be registered (unsupported buffer, device memory the provider cannot
    register, or the provider refused)."""


class Unsupported(AfabricError):
    """The provider does not support this operation."""


# ---- transport ----


class TransportError(AfabricError):
    """An operation failed in the provider or on the wire."""


class PeerUnreachable(TransportError, ConnectionError):
    """The peer is dead, unreachable or closed the connection."""


class OperationTimeout(TransportError, TimeoutError):
    """No completion within the engine's operation timeout."""


class EngineStuck(TransportError):
    """The engine's worker thread has been inside one provider call for
    ``afabric.WORKER_STUCK_S`` seconds and will not come back (seen with libfabric 1.17 shm:
    a same-host peer SIGKILLed while it held the lock of its shared region). Everything in
    flight failed with this error and the engine was closed; create a new one."""


class RemoteKeyRejected(TransportError, PermissionError):
    """The target refused the remote key or the range (deregistered or forged descriptor)."""


class ImmediatesDropped(TransportError):
    """Arrivals of the awaited immediate were dropped because the engine already counted
    ``max_imm_values`` other values: the expectation (or the operation triggered on the
    count) could never be met, so it fails at once. Raise ``Engine(max_imm_values=...)`` or
    expect values before their arrivals pile up."""


class PeerNotAllowed(UsageError, PermissionError):
    """The peer is not on the engine's allow-list (``Engine(allow_peers=...)``)."""


class Cancelled(AfabricError):
    """The operation was cancelled."""


_BY_NAME: dict[str, type[AfabricError]] = {
    "EAGAIN": TransportError,
    "EINVAL": InvalidArgument,
    "ERANGE": OutOfRange,
    "ECLOSED": EngineClosed,
    "ENOMEM": AfabricError,
    "EBADDESC": BadDescriptor,
    "ESTALE": StaleRegion,
    "ETOOBIG": MessageTooLarge,
    "ETIMEDOUT": OperationTimeout,
    "EPEER": PeerUnreachable,
    "EKEY": RemoteKeyRejected,
    "EIO": TransportError,
    "EPROVIDER": ProviderUnavailable,
    "EUNSUPPORTED": Unsupported,
    "ECANCELED": Cancelled,
    "EBUSY": Busy,
    "ENODEV": ProviderUnavailable,
    "EWRONGPROV": WrongProvider,
    "EREG": RegistrationError,
    "EDENIED": PeerNotAllowed,
    "ESTUCK": EngineStuck,
    "EDROPPED": ImmediatesDropped,
}


def known_code_names() -> frozenset[str]:
    """Shim error names this module maps (a test checks it against the shim's table)."""
    return frozenset(_BY_NAME) | {"OK"}


def from_code(name: str, code: int, operation: str, detail: str, provider: str = "") -> AfabricError:
    """The exception for a shim error code: `operation: detail (NAME) [provider=p]`."""
    cls = _BY_NAME.get(name, AfabricError)
    suffix = f" [provider={provider}]" if provider else ""
    err = cls(f"{operation}: {detail} ({name}){suffix}")
    err.code = code
    err.code_name = name
    err.operation = operation
    err.provider = provider
    return err
