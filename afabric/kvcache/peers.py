"""What both sides (decoder, prefiller) share: sending control messages without piling up
on a slow or dead peer, heartbeats, when each peer was last heard from, and their lifetime
(:class:`Side`: the receive loop, the heartbeat timer, bad-message accounting)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from ..address import Address
from ..engine import Engine
from ..errors import AfabricError, EngineClosed, InvalidArgument
from ..messages import TAG_KVCACHE
from . import wire
from .errors import ProtocolError


class Peers:
    """Who was heard when, and the control messages in flight to each peer.

    Heartbeats and confirmations are sent in background tasks so a peer that does not
    answer never stalls the loop; a heartbeat is skipped while the previous one to the
    same peer is still in flight."""

    def __init__(self, eng: Engine, role: int, log: logging.Logger) -> None:
        self.eng = eng
        self.role = role
        self.log = log
        self.me = bytes(eng.address)
        self.heard: dict[bytes, float] = {}
        self._beating: dict[bytes, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = 0
        self.send_failures = 0

    def saw(self, peer: bytes) -> None:
        self.heard[peer] = time.monotonic()

    def silent_for(self, peer: bytes, since: float) -> float:
        """Seconds since ``peer`` was last heard, counting from ``since`` at the earliest."""
        return time.monotonic() - max(self.heard.get(peer, since), since)

    async def send(self, peer: bytes, msg: bytes) -> None:
        """Send now and wait (raises the engine's error)."""
        await self.eng.send(Address.from_bytes(peer), msg, tag=TAG_KVCACHE)

    def post(self, peer: bytes, msg: bytes, what: str) -> asyncio.Task[None]:
        """Send in the background; a failure is logged and counted, not raised."""
        task = asyncio.ensure_future(self._quiet(peer, msg, what))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _quiet(self, peer: bytes, msg: bytes, what: str) -> None:
        try:
            await self.send(peer, msg)
        except AfabricError as e:
            self.send_failures += 1
            self.log.info("%s to %s failed: %s", what, peer.hex()[:16], e)

    def beat(self, peers: Iterable[bytes]) -> None:
        """One heartbeat to each of ``peers`` (skipping those whose last one is in flight)."""
        for peer in peers:
            prev = self._beating.get(peer)
            if prev is not None and not prev.done():
                continue
            self._seq += 1
            self._beating[peer] = self.post(
                peer, wire.encode_heartbeat(self.me, self.role, self._seq), "heartbeat"
            )
        for peer in [p for p, t in self._beating.items() if t.done()]:
            del self._beating[peer]

    def forget(self, peer: bytes) -> None:
        self.heard.pop(peer, None)

    async def aclose(self, timeout: float = 2.0) -> None:
        """Give control messages in flight a moment to leave, then drop them."""
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=timeout)
        for t in pending:
            t.cancel()
        for t in pending:
            with contextlib.suppress(BaseException):
                await t


async def every(interval: float, fn: Callable[[], None]) -> None:
    """Call ``fn`` every ``interval`` seconds until cancelled (errors are the caller's bug:
    they end the loop and surface in the task)."""
    while True:
        await asyncio.sleep(interval)
        fn()


async def receive_messages(
    eng: Engine, peers: Peers, handle: Callable[[wire.Message], None], bad: Callable[[str], None]
) -> None:
    """Parse every message the engine receives until it closes: a malformed one goes to
    ``bad`` (and nowhere else); a good one marks its sender alive, then goes to ``handle``."""
    while True:
        try:
            msg = await eng.recv_bytes(tag=TAG_KVCACHE)
        except EngineClosed:
            return
        try:
            m = wire.parse(msg)
        except ProtocolError as e:
            bad(str(e))
            continue
        peers.saw(m.sender)
        handle(m)


_S = TypeVar("_S", bound="Side")


class Side:
    """The lifetime the decoder and the prefiller share. A side consumes every message its
    engine receives (:meth:`_handle` gets the well-formed ones, :meth:`_bad` counts and
    logs the rest) and calls :meth:`_tick` every ``heartbeat_interval`` seconds (where it
    sends heartbeats and declares silent peers dead). Subclasses implement ``start``
    (calling :meth:`_start_loops` last), ``aclose`` (calling :meth:`_stop_loops`),
    ``_handle`` and ``_tick``."""

    def __init__(
        self, eng: Engine, role: int, logger: str, heartbeat_interval: float, peer_timeout: float
    ) -> None:
        if not 0 < heartbeat_interval < peer_timeout:
            raise InvalidArgument("need 0 < heartbeat_interval < peer_timeout")
        self.eng = eng
        self.heartbeat_interval = heartbeat_interval
        self.peer_timeout = peer_timeout
        self.log = logging.getLogger(logger)
        self.peers = Peers(eng, role, self.log)
        self._tasks: list[asyncio.Task[None]] = []
        self.bad_messages = 0
        self.last_bad_message = ""

    async def __aenter__(self: _S) -> _S:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def start(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError

    def _handle(self, m: wire.Message) -> None:
        raise NotImplementedError

    def _tick(self) -> None:
        raise NotImplementedError

    def _start_loops(self) -> None:
        """Start receiving and the heartbeat timer."""
        self._tasks = [
            asyncio.ensure_future(receive_messages(self.eng, self.peers, self._handle, self._bad)),
            asyncio.ensure_future(every(self.heartbeat_interval, self._tick)),
        ]

    async def _stop_loops(self, *also: asyncio.Task[None]) -> None:
        """Cancel the loops (and ``also``), then let control messages in flight leave
        (bounded)."""
        for t in [*self._tasks, *also]:
            t.cancel()
        for t in [*self._tasks, *also]:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        await self.peers.aclose()

    def _bad(self, why: str) -> None:
        self.bad_messages += 1
        self.last_bad_message = why
        self.log.warning("dropped a message: %s", why)
