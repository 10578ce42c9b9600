"""Errors of the KV-cache transfer, on afabric's hierarchy (so ``except AfabricError`` and
the builtin mix-ins keep working)."""

from __future__ import annotations

from ..errors import AfabricError, Cancelled, InvalidArgument, TransportError


class CacheFull(AfabricError, MemoryError):
    """Not enough free pages (or no contiguous run long enough) for a request."""


class ProtocolError(InvalidArgument):
    """A KV-cache message that is malformed, truncated, corrupted or inconsistent."""


class RequestRejected(AfabricError):
    """The prefiller refused the request (it says why); nothing was written."""


class RequestFailed(TransportError):
    """The transfer of a request failed (a write failed, or the peer died)."""


class RequestCancelled(Cancelled):
    """The request was cancelled."""
