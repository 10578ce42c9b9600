"""NIXL's status codes and the exceptions its Python bindings raise for them.

The classes carry NIXL's names so that code written against NIXL (``except
nixlRemoteDisconnectError``) works unchanged; each is a ``RuntimeError`` as upstream's are.
"""

from __future__ import annotations

from enum import IntEnum
from typing import NoReturn


class nixl_status_t(IntEnum):
    """What a NIXL call returns: in progress, success, or one of the errors."""

    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


class nixlError(RuntimeError):
    """Base of the errors below (not a NIXL name: upstream's derive from RuntimeError only)."""

    status = nixl_status_t.NIXL_ERR_UNKNOWN


class nixlNotPostedError(nixlError):
    """The transfer was never posted."""

    status = nixl_status_t.NIXL_ERR_NOT_POSTED


class nixlInvalidParamError(nixlError):
    """An argument NIXL rejects (lengths differ, an index out of range, a wrong side)."""

    status = nixl_status_t.NIXL_ERR_INVALID_PARAM


class nixlBackendError(nixlError):
    """The transport failed (afabric's error text follows)."""

    status = nixl_status_t.NIXL_ERR_BACKEND


class nixlNotFoundError(nixlError):
    """An unknown backend, agent, or memory not registered."""

    status = nixl_status_t.NIXL_ERR_NOT_FOUND


class nixlMismatchError(nixlError):
    """Metadata that cannot be decoded."""

    status = nixl_status_t.NIXL_ERR_MISMATCH


class nixlNotAllowedError(nixlError):
    """Not allowed in this state (another address for an agent already loaded)."""

    status = nixl_status_t.NIXL_ERR_NOT_ALLOWED


class nixlRepostActiveError(nixlError):
    """The transfer is still in progress."""

    status = nixl_status_t.NIXL_ERR_REPOST_ACTIVE


class nixlUnknownError(nixlError):
    """Anything else."""

    status = nixl_status_t.NIXL_ERR_UNKNOWN


class nixlNotSupportedError(nixlError):
    """A NIXL feature this layer does not provide."""

    status = nixl_status_t.NIXL_ERR_NOT_SUPPORTED


class nixlRemoteDisconnectError(nixlError):
    """The remote agent's process or engine is gone, or stopped answering."""

    status = nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT


class nixlCancelledError(nixlError):
    """The transfer was cancelled."""

    status = nixl_status_t.NIXL_ERR_CANCELED


class nixlNoTelemetryError(nixlError):
    """Telemetry is off for this agent."""

    status = nixl_status_t.NIXL_ERR_NO_TELEMETRY


ERRORS: dict[int, type[nixlError]] = {
    cls.status: cls
    for cls in (
        nixlNotPostedError,
        nixlInvalidParamError,
        nixlBackendError,
        nixlNotFoundError,
        nixlMismatchError,
        nixlNotAllowedError,
        nixlRepostActiveError,
        nixlUnknownError,
        nixlNotSupportedError,
        nixlRemoteDisconnectError,
        nixlCancelledError,
        nixlNoTelemetryError,
    )
}


def fail(status: nixl_status_t, detail: str) -> NoReturn:
    """Raise the exception NIXL's bindings raise for ``status``, naming the cause."""
    raise ERRORS.get(int(status), nixlUnknownError)(f"{status.name}: {detail}")
