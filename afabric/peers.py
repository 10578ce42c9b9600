"""Peer-up / peer-down events (:meth:`afabric.Engine.peer_events`).

A peer is an engine this one has resolved: an :class:`~afabric.Address` it wrote or sent to,
made a peer group of, or the owner of a descriptor it imported; or an engine that resolved
this one (it says hello, shim/keepalive.c, and is resolved in turn). Each is reported ``"up"``
once when first resolved, and ``"down"`` once its process is gone (same-host peers: the
shim watches the process through a pidfd, see shim/peers.c) or its engine was closed (it
says goodbye). Down because the process exited or the engine closed is final for that
address (a new engine is a new address, even at the same NIC address: a new incarnation);
with ``peer_stop_timeout`` a stopped process is reported down, then up when it runs again;
with ``heartbeat`` a peer that leaves heartbeats unanswered for ``HEARTBEAT_MISSES`` intervals
is reported down ("silent"), then up when it answers again.
What is kept is one state per resolved peer, so it is bounded by the peers the engine knows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from . import errors
from ._native_decl import HEARTBEAT_MISSES
from .address import Address

# HEARTBEAT_MISSES (the shim's AFS_HEARTBEAT_MISSES): heartbeat intervals without an answer
# after which a peer is reported down ("silent")
__all__ = ["HEARTBEAT_MISSES", "PEER_CLOSED", "PeerEvent", "PeerHub", "heartbeat_ms", "stop_ms"]

PEER_CLOSED = 4  # a PEER record's flag (the shim's AFS_C_PEER): down because its engine closed

Reason = Literal["resolved", "exited", "stopped", "resumed", "closed", "silent"]


def stop_ms(timeout: float | None) -> int:
    """``Engine(peer_stop_timeout=)`` in ms for the shim: None = off (0)."""
    if timeout is None:
        return 0
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0.001 <= timeout <= 3600:
        raise errors.InvalidArgument(f"peer_stop_timeout must be None or 0.001..3600 s, got {timeout!r}")
    return max(1, round(timeout * 1000))


def heartbeat_ms(interval: float | None) -> int:
    """``Engine(heartbeat=)`` in ms for the shim: None = off (0)."""
    if interval is None:
        return 0
    if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not 0.01 <= interval <= 3600:
        raise errors.InvalidArgument(f"heartbeat must be None or 0.01..3600 s, got {interval!r}")
    return max(10, round(interval * 1000))


@dataclass(frozen=True)
class PeerEvent:
    """A peer came up (was resolved) or went down (its process is gone, its engine closed)."""

    kind: Literal["up", "down"]
    address: Address
    pid: int | None
    """The peer's process id where the address names it, else None."""
    watched: bool
    """Whether the peer's process is watched (same host): only then is "down" reported
    without an operation failing first."""
    reason: Reason
    """Why: "up" when first resolved ("resolved") or when a stopped or silent peer runs or
    answers again ("resumed"); "down" when its process exited ("exited", final), its engine
    was closed ("closed", final: it said goodbye), it has been stopped for
    ``peer_stop_timeout`` ("stopped") or left ``heartbeat``'s keepalives unanswered for
    ``HEARTBEAT_MISSES`` intervals ("silent")."""


class PeerHub:
    """The engine's peer states and its subscribers (loop thread only)."""

    def __init__(self) -> None:
        self._state: dict[bytes, PeerEvent] = {}
        self._subs: list[asyncio.Queue[PeerEvent | None]] = []

    def publish(self, blob: bytes, down: bool, pid: int, flags: int) -> None:
        """A PEER record: `flags` 1 its process is watched, down because 2 stopped, 4 its
        engine closed (PEER_CLOSED), 8 silent (else exited)."""
        if not blob:
            return
        prev = self._state.get(blob)
        reason: Reason = "resolved" if prev is None else "resumed"
        if down:
            reason = (
                "stopped" if flags & 2 else "closed" if flags & 4 else "silent" if flags & 8 else "exited"
            )
        if prev is not None and (prev.reason in ("exited", "closed") or (prev.kind == "up") == (not down)):
            return  # exited and closed are final; otherwise states alternate
        ev = PeerEvent(
            "down" if down else "up", Address.from_bytes(blob), pid or None, bool(flags & 1), reason
        )
        self._state[blob] = ev
        for q in self._subs:
            q.put_nowait(ev)

    def is_known_up(self, blob: bytes) -> bool:
        ev = self._state.get(blob)
        return ev is not None and ev.kind == "up"

    def is_down(self, addr: Address) -> bool:
        ev = self._state.get(bytes(addr))
        return ev is not None and ev.kind == "down"

    def close(self) -> None:
        subs, self._subs = self._subs, []
        for q in subs:
            q.put_nowait(None)

    async def iterate(self, closed: bool) -> AsyncIterator[PeerEvent]:
        """The current state of every peer known so far, then each change, until the engine
        closes."""
        q: asyncio.Queue[PeerEvent | None] = asyncio.Queue()
        for known in self._state.values():
            q.put_nowait(known)
        if closed:
            q.put_nowait(None)
        else:
            self._subs.append(q)
        try:
            while True:
                got = await q.get()
                if got is None:
                    return
                yield got
        finally:
            if q in self._subs:
                self._subs.remove(q)
