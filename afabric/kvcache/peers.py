"""What both sides (decoder, prefiller) share: sending control messages without piling up
on a slow or dead peer, heartbeats, when each peer was last heard from, who may speak for
whom, and their lifetime (:class:`Side`: the receive loop, the heartbeat timer, bad and
forged message accounting).

A control message names its sender inside (the wire format's sender field), and every
decision keys on that name: whose request a ``CANCEL`` stops, which prefiller a ``CONFIRM``
or ``READY`` answers for, which peer a heartbeat keeps alive. So a message is taken only
from the engine it names, as the transport reports it (:class:`afabric.Message` ``.sender``,
put there by the sending engine and, where the provider names senders, checked by the
receiving engine: ``.verified``). Where the provider cannot vouch for a message
(``verified=False``: it cannot name senders, or the sender was not resolved here yet) the
claim is taken, as the engine takes it, except in the name of a peer whose messages have
come verified before: the provider names that peer, so an unverified message claiming to
be it comes from someone else. (A message that fits one receive buffer is checked when it
is polled, in order with its sender's other messages, so once one came verified all later
ones do. Request fragments are the exception: one may travel as a large message, checked
when it was announced, possibly before its sender was resolved here, and delivered after
the sender's later small messages; a fragment only adds to a request under its sender's
own name and an id that sender drew, so it is taken unverified.)"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from .. import messages
from ..address import Address
from ..engine import Engine
from ..errors import AfabricError, EngineClosed, InvalidArgument
from ..messages import TAG_KVCACHE
from . import wire
from .errors import ProtocolError

_VOUCHED = 65536  # peers remembered as named by the provider (least recently heard forgotten first)


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
        self._vouched: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._beating: dict[bytes, asyncio.Task[None]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._seq = 0
        self.send_failures = 0

    def saw(self, peer: bytes) -> None:
        self.heard[peer] = time.monotonic()

    def impostor(self, m: wire.Message, msg: messages.Message) -> str:
        """Why ``m`` (received as ``msg``) may not act in the name it carries, or "" when
        it may: it must come from the engine it names, and, for a peer the provider has
        named before, be named by the provider this time too."""
        sent_by = bytes(msg.sender)
        kind = type(m).__name__.lower()
        if m.sender != sent_by:
            return f"a {kind} naming {m.sender.hex()[:16]} sent by {sent_by.hex()[:16]}"
        if msg.verified:
            self._vouched[sent_by] = None
            self._vouched.move_to_end(sent_by)
            while len(self._vouched) > _VOUCHED:
                self._vouched.popitem(last=False)
        elif sent_by in self._vouched and not isinstance(m, wire.Fragment):
            return f"a {kind} in the name of {sent_by.hex()[:16]} that the provider does not vouch for"
        return ""

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
    eng: Engine,
    peers: Peers,
    handle: Callable[[wire.Message], None],
    bad: Callable[[str], None],
    forged: Callable[[str], None],
) -> None:
    """Parse every message the engine receives until it closes: a malformed one goes to
    ``bad``, one not from the peer it names to ``forged`` (and nowhere else); a good one
    marks its sender alive, then goes to ``handle``."""
    while True:
        try:
            msg = await eng.recv(tag=TAG_KVCACHE)
        except EngineClosed:
            return
        try:
            m = wire.parse(msg.data)
        except ProtocolError as e:
            bad(str(e))
            continue
        why = peers.impostor(m, msg)
        if why:
            forged(why)
            continue
        peers.saw(m.sender)
        handle(m)


_S = TypeVar("_S", bound="Side")


class Side:
    """The lifetime the decoder and the prefiller share. A side consumes every message its
    engine receives (:meth:`_handle` gets the well-formed ones from the peers they name,
    :meth:`_bad` counts and logs malformed ones, :meth:`_forged` the others) and calls
    :meth:`_tick` every ``heartbeat_interval`` seconds (where it sends heartbeats and
    declares silent peers dead). Subclasses implement ``start``
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
        self.forged_messages = 0
        """Messages dropped because they did not come from the peer they name."""
        self.last_forged_message = ""

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
            asyncio.ensure_future(
                receive_messages(self.eng, self.peers, self._handle, self._bad, self._forged)
            ),
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

    def _forged(self, why: str) -> None:
        self.forged_messages += 1
        self.last_forged_message = why
        if self.forged_messages == 1:
            self.log.warning("dropped %s (further ones are counted in forged_messages)", why)
        else:
            self.log.debug("dropped %s", why)
