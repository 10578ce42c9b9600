"""Peer-up / peer-down events (:meth:`afabric.Engine.peer_events`).

A peer is an engine this one has resolved: an :class:`~afabric.Address` it wrote or sent to,
made a peer group of, or the owner of a descriptor it imported. Each is reported ``"up"``
once when first resolved, and ``"down"`` once its process is gone (same-host peers: the
shim watches the process through a pidfd, see shim/peers.c). Down is final for that address
(a restarted peer is a new engine, with a new address). What is kept is one state per
resolved peer, so it is bounded by the peers the engine knows.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Literal

from .address import Address


@dataclass(frozen=True)
class PeerEvent:
    """A peer came up (was resolved) or went down (its process is gone)."""

    kind: Literal["up", "down"]
    address: Address
    pid: int | None
    """The peer's process id where the address names it, else None."""
    watched: bool
    """Whether the peer's process is watched (same host): only then is "down" reported
    without an operation failing first."""


class PeerHub:
    """The engine's peer states and its subscribers (loop thread only)."""

    def __init__(self) -> None:
        self._state: dict[bytes, PeerEvent] = {}
        self._subs: list[asyncio.Queue[PeerEvent | None]] = []

    def publish(self, blob: bytes, down: bool, pid: int, watched: bool) -> None:
        if not blob:
            return
        prev = self._state.get(blob)
        if prev is not None and (prev.kind == "down" or not down):
            return  # one "up", then at most one "down", per address
        ev = PeerEvent("down" if down else "up", Address.from_bytes(blob), pid or None, watched)
        self._state[blob] = ev
        for q in self._subs:
            q.put_nowait(ev)

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
