"""A NIXL transfer request: its descriptor pairs, its state and its telemetry.

States: created (``NIXL_ERR_NOT_POSTED``) -> posted (``NIXL_IN_PROG``) -> ``NIXL_SUCCESS``
or an error status. A request can be posted again once it is no longer in progress (NIXL's
repost: the same pairs, moved again, with the notification given then or at creation);
posting one still in progress is ``NIXL_ERR_REPOST_ACTIVE``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from ... import errors
from .._core import Transfer, TransferTimeout
from .enums import nixl_xfer_op_t
from .status import nixl_status_t

# afabric's errors that mean "the remote agent is gone or stopped answering"
_DISCONNECTED = (errors.PeerUnreachable, errors.OperationTimeout, errors.EngineStuck, TransferTimeout)


def status_of(exc: BaseException) -> nixl_status_t:
    """The NIXL status a failed transfer reports."""
    if isinstance(exc, _DISCONNECTED):
        return nixl_status_t.NIXL_ERR_REMOTE_DISCONNECT
    if isinstance(exc, errors.Cancelled):
        return nixl_status_t.NIXL_ERR_CANCELED
    return nixl_status_t.NIXL_ERR_BACKEND


class nixlXferTelemetry:
    """A finished transfer's telemetry: times in microseconds, bytes and descriptors."""

    __slots__ = ("descCount", "postDuration", "startTime", "totalBytes", "xferDuration")

    def __init__(
        self,
        startTime: int = 0,
        postDuration: int = 0,
        xferDuration: int = 0,
        totalBytes: int = 0,
        descCount: int = 0,
    ) -> None:
        self.startTime = startTime  # µs on the monotonic clock when the post began
        self.postDuration = postDuration  # µs the post call took
        self.xferDuration = xferDuration  # µs from the post's start to the completion seen
        self.totalBytes = totalBytes
        self.descCount = descCount

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, descCount={self.descCount})"
        )


@dataclass
class XferRequest:
    """What ``createXferReq`` / ``makeXferReq`` made; the agent keeps it under an int handle."""

    op: nixl_xfer_op_t
    remote: str  # the remote agent's name (this agent's own for a loopback transfer)
    generation: int  # of the remote agent's metadata when made: a reloaded agent is another one
    local_addrs: npt.NDArray[np.int64]
    remote_addrs: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    notif: bytes | None
    backend: int  # the backend handle it runs on
    status: nixl_status_t = nixl_status_t.NIXL_ERR_NOT_POSTED
    transfer: Transfer | None = None
    error: BaseException | None = None
    _t0: float = 0.0
    _start_us: int = 0
    _post_us: int = 0
    _xfer_us: int = 0

    @property
    def kind(self) -> Literal["write", "read"]:
        return "write" if self.op == nixl_xfer_op_t.NIXL_WRITE else "read"

    def active(self) -> bool:
        """Still in progress (polls once)."""
        return self.refresh() == nixl_status_t.NIXL_IN_PROG

    def begin(self) -> None:
        """The post starts now (telemetry's clock)."""
        self._t0 = time.perf_counter()
        self._start_us = max(1, time.monotonic_ns() // 1000)
        self.error = None

    def posted(self, transfer: Transfer) -> None:
        self.transfer = transfer
        self.status = nixl_status_t.NIXL_IN_PROG
        self._post_us = max(1, round((time.perf_counter() - self._t0) * 1e6))

    def failed(self, status: nixl_status_t, exc: BaseException | None) -> None:
        self.status = status
        self.error = exc

    def refresh(self) -> nixl_status_t:
        """Look at the transfer in flight and update the status."""
        if self.status != nixl_status_t.NIXL_IN_PROG or self.transfer is None:
            return self.status
        state = self.transfer.poll()
        if state == "pending":
            return self.status
        if state == "done":
            self.status = nixl_status_t.NIXL_SUCCESS
            self._xfer_us = max(self._post_us, round((time.perf_counter() - self._t0) * 1e6), 1)
        else:
            exc = self.transfer.error
            self.failed(status_of(exc) if exc is not None else nixl_status_t.NIXL_ERR_UNKNOWN, exc)
        return self.status

    def cancel(self) -> None:
        """Stop a transfer in flight: its operations still complete (afabric cannot recall a
        posted operation) but its notification is not sent."""
        if self.transfer is not None and self.status == nixl_status_t.NIXL_IN_PROG:
            self.transfer.cancel()
            self.failed(
                nixl_status_t.NIXL_ERR_CANCELED, errors.Cancelled("transfer released while in flight")
            )

    def telemetry(self) -> nixlXferTelemetry:
        return nixlXferTelemetry(
            self._start_us, self._post_us, self._xfer_us, int(self.lengths.sum()), len(self.lengths)
        )
