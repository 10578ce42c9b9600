"""Engine's two-sided half: send / recv with senders, tags and any size (messages.py has
the frames). A mixin so that engine.py keeps only the hooks; everything here runs on the
engine's loop thread."""

from __future__ import annotations

import asyncio
import collections
import logging
import secrets
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _native, errors
from . import messages as m
from ._ops import Op
from .address import Address
from .memory import MemoryRegion
from .stats import MessageStats

# Fragments of one large message in flight at once (the receiver's rx_depth defaults to 128).
_WINDOW = 32


class _Partial:
    """A large message being reassembled: memory reserved when its RTS was granted."""

    __slots__ = ("buf", "got", "last", "seen", "sender", "tag", "total", "verified", "waiter")

    def __init__(
        self,
        sender: Address,
        tag: int,
        total: int,
        verified: bool,
        into: tuple[asyncio.Future[m.Message], memoryview] | None = None,
    ) -> None:
        self.sender = sender
        self.tag = tag
        self.total = total
        self.verified = verified
        # straight into a waiting recv_into's buffer, or into memory of its own (reserved)
        self.waiter = into[0] if into else None
        self.buf: bytearray | memoryview = into[1][:total] if into else bytearray(total)
        self.got = 0
        self.seen: set[int] = set()
        self.last = time.monotonic()


class _Ask:
    """A sender's RTS waiting for the receiver's answer."""

    __slots__ = ("future", "peer")

    def __init__(self, future: asyncio.Future[int], peer: bytes) -> None:
        self.future = future
        self.peer = peer


class MessagingMixin:
    # provided by Engine
    _n: _native.NativeEngine
    _loop: asyncio.AbstractEventLoop
    _ops: dict[int, Op]
    _peers: dict[bytes, int]
    _max_queued: int
    queue_overflow: str
    op_timeout: float
    max_message_size: int
    address: Address
    fabric_provider: str
    log: logging.Logger
    _closed: bool
    _polling: bool
    _poll_window: float

    if TYPE_CHECKING:

        def _check_loop(self) -> None: ...
        def _start_poll(self) -> None: ...
        def _peer(self, address: Any) -> tuple[int, int]: ...
        async def _wait(self, op_id: int, verb: str, peer: int, refs: tuple[Any, ...], kind: str) -> None:
            return None

    def _init_messages(self, max_queued_bytes: int) -> None:
        self._max_queued_bytes = max_queued_bytes
        # per tag: (message, bytes it holds of the max_queued_bytes budget)
        self._inbox: dict[int, collections.deque[tuple[m.Message, int]]] = {}
        self._n_queued = 0
        # messages beyond max_queued_messages: their receive buffers stay out of the
        # provider's hands until recv() catches up, which holds the senders back
        self._held_rx: collections.deque[tuple[m.Message, int]] = collections.deque()
        self._held_back = 0  # messages that found the queue full (stats)
        self._dropped = 0
        self._recv_waiters: dict[int, collections.deque[asyncio.Future[m.Message]]] = {}
        self._by_handle: dict[int, Address] = {}  # provider handle -> resolved peer
        self._claims: dict[bytes, Address] = {}  # sender addresses seen in headers
        self._into: dict[asyncio.Future[m.Message], memoryview] = {}  # recv_into waiters' buffers
        self._partials: dict[tuple[bytes, int], _Partial] = {}
        # announced large messages waiting for room: (sender, verified, tag, id, size, when)
        self._pending_rts: collections.deque[tuple[Address, bool, int, int, int, float]] = collections.deque()
        self._asks: dict[int, _Ask] = {}
        self._reserved = 0  # bytes of large messages reserved: being reassembled or queued
        self._msg_tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._forged = 0
        self._malformed = 0
        self._expired = 0
        self._refused = 0

    # ---- sending ----

    async def send(self, peer: Address, data: bytes | bytearray | memoryview, *, tag: int = 0) -> None:
        """Two-sided send of any size to ``peer``, received there by ``recv(tag=tag)``.

        A message larger than one of the peer's receive buffers is announced first and sent in
        fragments once the peer has reserved room for it.

        Args:
            peer: the receiving engine's address (or its bytes).
            data: the bytes to send.
            tag: the application tag, 0..``afabric.TAG_MAX``.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop.
            InvalidArgument: ``tag`` is out of range or ``data`` is not bytes-like.
            MessageTooLarge: larger than the peer's ``max_queued_bytes`` (nothing is sent).
            PeerNotAllowed: the peer is not on the allow-list.
            PeerUnreachable: the peer's process or engine is gone.
            OperationTimeout: the peer made no room, or did not answer, within ``op_timeout``.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise errors.InvalidType(
                f"send takes bytes, bytearray or memoryview, got {type(data).__name__}"
                + (" (encode text first, e.g. data.encode())" if isinstance(data, str) else "")
            )
        tag = m.check_tag(tag)
        if not isinstance(peer, Address):
            if not isinstance(peer, (bytes, bytearray, memoryview)):
                raise errors.InvalidArgument(f"peer must be an Address, got {type(peer).__name__}")
            peer = Address.from_bytes(peer)
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            try:
                view = view.cast("B")
            except TypeError:  # not C-contiguous: one copy
                view = memoryview(view.tobytes())
        me = bytes(self.address)
        pid, inc = self._peer(peer)
        limit = m.max_message_of(peer) or self.max_message_size
        room = limit - m.HEADER - len(me)
        if room <= 0:
            raise errors.MessageTooLarge(
                f"send to {peer.short()}: its {limit}-byte messages cannot hold afabric's "
                f"{m.HEADER + len(me)}-byte header (max_message_size too small)"
            )
        if len(view) <= room:
            op = self._n.send("send", pid, m.frame(m.K_DATA, me, tag, payload=view))
            await self._wait(op, "send", inc, (), "send")
            return
        await self._send_large(peer, pid, inc, view, tag, me, room)

    async def _send_large(
        self, peer: Address, pid: int, inc: int, view: memoryview, tag: int, me: bytes, room: int
    ) -> None:
        total = len(view)
        msg_id = secrets.randbits(64)
        ask = _Ask(self._loop.create_future(), bytes(peer))
        self._asks[msg_id] = ask
        try:
            op = self._n.send("send", pid, m.frame(m.K_RTS, me, tag, msg_id, total))
            await self._wait(op, "send (request to send)", inc, (), "send")
            self._sweep_soon()
            limit = self.op_timeout or None
            try:
                answer = await asyncio.wait_for(ask.future, limit)
            except asyncio.TimeoutError:
                raise errors.OperationTimeout(
                    f"send of {total} bytes to {peer.short()}: the receiver did not take it within "
                    f"op_timeout={self.op_timeout} s (its queue full, or it is gone); nothing sent"
                ) from None
        finally:
            self._asks.pop(msg_id, None)
        if answer >= 0:
            raise errors.MessageTooLarge(
                f"send of {total} bytes to {peer.short()}: the receiver takes at most {answer} bytes"
            )
        inflight: collections.deque[asyncio.Future[None]] = collections.deque()
        try:
            for off in range(0, total, room):
                if len(inflight) >= _WINDOW:
                    await inflight.popleft()
                chunk = view[off : off + room]
                op = self._n.send("send", pid, m.frame(m.K_FRAG, me, off, msg_id, payload=chunk))
                inflight.append(self._track_send(op, inc))
            while inflight:
                await inflight.popleft()
        finally:
            for fut in inflight:  # after a failure or a cancel: nobody awaits these
                fut.add_done_callback(_consume)

    def _track_send(self, op_id: int, inc: int) -> asyncio.Future[None]:

        fut: asyncio.Future[None] = self._loop.create_future()
        self._ops[op_id] = (fut, "send (fragment)", inc, (), "send")
        if not self._polling and self._poll_window:
            self._start_poll()  # a stream of fragments: _poll_tick stops when many are in flight
        return fut

    def _post(self, peer: Address, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        """A control frame in the background (failures are logged)."""

        async def go() -> None:
            try:
                pid, inc = self._peer(peer)
                op = self._n.send("send", pid, m.frame(kind, bytes(self.address), a, b, c))
                await self._wait(op, "send (control)", inc, (), "send")
            except errors.AfabricError as e:
                self.log.info("control message to %s failed: %s", peer.short(), e)

        task = self._loop.create_task(go())
        self._msg_tasks.add(task)
        task.add_done_callback(self._msg_tasks.discard)

    # ---- receiving ----

    async def recv(self, *, tag: int = 0) -> m.Message:
        """The next message with ``tag``, from any sender.

        Messages of other tags stay queued for their own ``recv``; several ``recv`` on one tag are
        served oldest first. Cancelling never loses a message.

        Args:
            tag: the application tag, 0..``afabric.TAG_MAX``.

        Returns:
            The message: ``.data``, ``.sender`` (reply to it), ``.tag``, ``.verified``.

        Raises:
            EngineClosed: the engine is closed (before or while waiting).
            UsageError: called from another thread or event loop.
            InvalidArgument: ``tag`` is out of range.
        """
        self._check_loop()
        return await self._recv(m.check_tag(tag), None)

    async def _recv(self, tag: int, into: memoryview | None) -> m.Message:
        got = self._take(tag)
        if got is not None:
            return got
        fut: asyncio.Future[m.Message] = self._loop.create_future()
        waiters = self._recv_waiters.setdefault(tag, collections.deque())
        waiters.append(fut)
        if into is not None:
            self._into[fut] = into
        self._grant_pending()  # a waiter makes room for a large message of this tag
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                msg = fut.result()  # delivered as the task was cancelled: keep it
                if into is not None and isinstance(msg.data, memoryview):  # not in buf: it is the caller's
                    msg = m.Message(bytes(msg.data), msg.sender, msg.tag, msg.verified)
                self._inbox.setdefault(tag, collections.deque()).appendleft((msg, 0))
                self._n_queued += 1
            raise
        finally:
            self._into.pop(fut, None)
            if not fut.done() or fut.cancelled():
                fut.cancel()
                self._unbind(fut)
            q = self._recv_waiters.get(tag)
            if q is not None:
                if fut in q:
                    q.remove(fut)
                if not q:
                    del self._recv_waiters[tag]

    async def recv_bytes(self, *, tag: int = 0) -> bytes:
        """Only the bytes of the next message with ``tag``.

        Args:
            tag: the application tag, 0..``afabric.TAG_MAX``.

        Returns:
            The message's bytes.

        Raises:
            EngineClosed: the engine is closed (before or while waiting).
            UsageError: called from another thread or event loop.
            InvalidArgument: ``tag`` is out of range.
        """
        msg = await self.recv(tag=tag)
        return msg.data if isinstance(msg.data, bytes) else bytes(msg.data)

    async def recv_into(self, buf: Any, *, tag: int = 0) -> m.Message:
        """The next message with ``tag``, copied into ``buf``.

        A large message announced while this waits is reassembled in ``buf`` itself (no memory of
        the engine's); one already queued is copied there.

        Args:
            buf: a writable buffer, or a host memory region of this engine.
            tag: the application tag, 0..``afabric.TAG_MAX``.

        Returns:
            The message; its ``data`` is a memoryview of ``buf`` holding it.

        Raises:
            EngineClosed: the engine is closed (before or while waiting).
            UsageError: called from another thread or event loop.
            InvalidArgument: ``buf`` is not writable, or ``tag`` is out of range.
            MessageTooLarge: the next message is larger than ``buf`` (it stays queued).
        """
        if isinstance(buf, MemoryRegion):
            buf.check(self)  # type: ignore[arg-type]
            try:
                target = memoryview(buf.buffer).cast("B")
            except TypeError:
                raise errors.InvalidArgument(
                    "recv_into: this region's memory is not a host buffer (use recv and copy)"
                ) from None
        else:
            try:
                target = memoryview(buf).cast("B")
            except TypeError:
                raise errors.InvalidType(
                    f"recv_into takes a writable buffer or a MemoryRegion, got {type(buf).__name__}"
                ) from None
        if target.readonly:
            raise errors.InvalidArgument("recv_into needs a writable buffer")
        self._check_loop()
        msg = await self._recv(m.check_tag(tag), target)
        if isinstance(msg.data, memoryview) and msg.data.obj is target.obj:
            return msg  # a large message reassembled in place
        n = len(msg.data)
        if n > len(target):
            self._inbox.setdefault(msg.tag, collections.deque()).appendleft((msg, 0))
            self._n_queued += 1
            raise errors.MessageTooLarge(
                f"recv_into: the next message with tag {tag} has {n} bytes, the buffer {len(target)} "
                "(the message stays queued)"
            )
        target[:n] = msg.data
        return m.Message(target[:n], msg.sender, msg.tag, msg.verified)

    def _take(self, tag: int) -> m.Message | None:
        q = self._inbox.get(tag)
        if q:
            msg, reserved = q.popleft()
            if not q:
                del self._inbox[tag]
            self._n_queued -= 1
            self._reserved -= reserved
            if self._held_rx:
                self._refill()
            if reserved or self._pending_rts:
                self._grant_pending()
            return msg
        for i, (msg, slot) in enumerate(self._held_rx):  # max_queued_messages=0, or all held
            if msg.tag == tag:
                del self._held_rx[i]
                self._n.release_recv([slot])
                return msg
        return None

    def _recv_room(self) -> int:
        waiting = sum(len(q) for q in self._recv_waiters.values())
        return self._max_queued + waiting - self._n_queued - len(self._held_rx)

    def _sender(self, blob: bytes, src: int) -> tuple[Address, bool] | None:
        """The sender a frame claims, checked against the provider's: (address, verified),
        or None for a forgery (the provider names another resolved peer)."""
        claimed = self._claims.get(blob)
        if claimed is None:  # decoded and checked once per address (not per fragment)
            claimed = Address.from_bytes(blob)
            if len(self._claims) >= 4096:
                self._claims.clear()
            self._claims[blob] = claimed
        if src in (_native.SRC_UNKNOWN, _native.SRC_UNRESOLVED):
            # not named (or not yet resolved here: a message polled before its sender was
            # resolved reports so too, which is why this is no proof of a forgery)
            return claimed, False
        if self._by_handle.get(src) == claimed:
            return claimed, True
        # Not the peer last seen at that handle: resolved in the shim only (a descriptor's
        # owner, the allow-list), or a restarted engine at the same NIC address (the
        # provider's address vector gives it the old handle). It is the sender if the
        # address it claims resolves to the handle the provider names; else a forgery.
        try:
            pid, _ = self._peer(claimed)
            if not self._n.peer_source(pid, src):
                return None
        except errors.AfabricError:
            return None
        self._by_handle[src] = claimed
        return claimed, True

    def _deliver(self, payload: bytes, slot: int = -1, src: int = _native.SRC_UNKNOWN) -> None:
        try:
            kind, a, b, c, blob, body = m.parse(payload)
            who = self._sender(blob, src)
        except (ValueError, errors.AfabricError) as e:
            self._malformed += 1
            if self._malformed & (self._malformed - 1) == 0:
                self.log.warning("%d malformed message(s) dropped so far: %s", self._malformed, e)
            who = None
            kind = 0
        else:
            if who is None:
                self._forged += 1
                if self._forged & (self._forged - 1) == 0:
                    self.log.warning(
                        "%d message(s) dropped so far whose header names another sender than the "
                        "provider does", self._forged,
                    )  # fmt: skip
        if who is None or kind != m.K_DATA:
            if slot >= 0:
                self._n.release_recv([slot])
            if who is not None:
                self._control(kind, who[0], who[1], a, b, c, body)
            return
        msg = m.Message(bytes(body), who[0], a, who[1])
        self._enqueue(msg, slot)

    def _enqueue(self, msg: m.Message, slot: int = -1, reserved: int = 0) -> None:
        q = self._recv_waiters.get(msg.tag)
        while q:
            w = q.popleft()
            if not w.done():
                w.set_result(msg)
                self._reserved -= reserved
                if slot >= 0:
                    self._n.release_recv([slot])
                return
        if slot < 0 or self._n_queued < self._max_queued:
            self._inbox.setdefault(msg.tag, collections.deque()).append((msg, reserved))
            self._n_queued += 1
            if slot >= 0:
                self._n.release_recv([slot])
            return
        self._held_back += 1
        if self.queue_overflow == "drop":
            self._n.release_recv([slot])
            self._dropped += 1
            if self._dropped & (self._dropped - 1) == 0:  # the first, then at powers of two
                self.log.warning(
                    "%d received message(s) dropped so far: %d queued, not taken with recv() "
                    "(max_queued_messages; %s cannot hold its senders back safely)",
                    self._dropped, self._n_queued, self.fabric_provider,
                )  # fmt: skip
            return
        # the queue is full: keep the receive buffer from the provider (back-pressure)
        if not self._held_rx:
            self.log.warning(
                "%d received messages not taken with recv(): receive buffers are withheld, "
                "senders are held back until recv() catches up", self._n_queued,
            )  # fmt: skip
        self._held_rx.append((msg, slot))

    def _refill(self) -> None:
        """recv() made room: withheld messages join the queue, their buffers go back."""
        slots: list[int] = []
        while self._held_rx and self._n_queued < self._max_queued:
            msg, slot = self._held_rx.popleft()
            self._inbox.setdefault(msg.tag, collections.deque()).append((msg, 0))
            self._n_queued += 1
            slots.append(slot)
        if slots:
            self._n.release_recv(slots)
        if not self._held_rx:
            self.log.info("received-message queue below max_queued_messages again")

    # ---- large messages ----

    def _control(
        self, kind: int, who: Address, verified: bool, a: int, b: int, c: int, body: memoryview
    ) -> None:
        if kind == m.K_FRAG:
            self._fragment(who, b, a, body)
        elif kind == m.K_RTS:
            if c > self._max_queued_bytes:
                self._refused += 1
                self._post(who, m.K_REFUSE, 0, b, self._max_queued_bytes)
            elif a <= m.TAG_MAX or a in m.RESERVED_TAGS:
                self._pending_rts.append((who, verified, a, b, c, time.monotonic()))
                self._grant_pending()
                while len(self._pending_rts) > max(self._max_queued, 1):  # bounded: the newest wait
                    self._pending_rts.pop()  # its sender times out
                    self._dropped += 1
                self._sweep_soon()
            else:
                self._malformed += 1
        elif kind in (m.K_CTS, m.K_REFUSE):
            ask = self._asks.get(b)
            if ask is not None and ask.peer == bytes(who) and not ask.future.done():
                ask.future.set_result(-1 if kind == m.K_CTS else c)

    def _grant_pending(self) -> None:
        """Reserve room for waiting large messages, oldest first, while the bounds allow."""
        while self._pending_rts:
            who, verified, tag, msg_id, total, _ = self._pending_rts[0]
            fits = self._reserved + total <= self._max_queued_bytes or any(
                len(self._into.get(w, b"")) >= total for w in self._recv_waiters.get(tag, ())
            )
            room = bool(self._recv_waiters.get(tag)) or (
                self._n_queued + len(self._partials) < self._max_queued
            )
            if not (fits and room):
                return
            self._pending_rts.popleft()
            key = (bytes(who), msg_id)
            if key in self._partials:
                continue
            into = self._bind(tag, total)
            self._partials[key] = _Partial(who, tag, total, verified, into)
            if into is None:
                self._reserved += total
            self._post(who, m.K_CTS, 0, msg_id)
            self._sweep_soon()

    def _bind(self, tag: int, total: int) -> tuple[asyncio.Future[m.Message], memoryview] | None:
        """The oldest recv_into waiting on ``tag`` with room for ``total`` bytes: taken off
        the waiters, the message is reassembled in its buffer."""
        q = self._recv_waiters.get(tag)
        for w in q or ():
            target = self._into.get(w)
            if target is not None and len(target) >= total and not w.done():
                q.remove(w)  # type: ignore[union-attr]
                return w, target
        return None

    def _unbind(self, fut: asyncio.Future[m.Message]) -> None:
        """A recv_into whose buffer a large message was being reassembled in went away:
        the message goes on in memory of its own (reserved; the bound may be exceeded)."""
        for p in self._partials.values():
            if p.waiter is fut:
                p.waiter = None
                p.buf = bytearray(p.buf)
                self._reserved += p.total
                return

    def _fragment(self, who: Address, msg_id: int, offset: int, body: memoryview) -> None:
        key = (bytes(who), msg_id)
        p = self._partials.get(key)
        n = len(body)
        if p is None or offset + n > p.total or offset in p.seen:
            return  # not granted, expired, or a duplicate: dropped
        p.buf[offset : offset + n] = body
        p.seen.add(offset)
        p.got += n
        p.last = time.monotonic()
        if p.got < p.total:
            return
        del self._partials[key]
        msg = m.Message(memoryview(p.buf), p.sender, p.tag, p.verified)
        if p.waiter is not None and not p.waiter.done():
            p.waiter.set_result(msg)  # in its recv_into's buffer
            return
        self._enqueue(msg, -1, p.total)

    def _sweep_soon(self) -> None:
        if self._sweeper is None and not self._closed:
            period = min(1.0, max(self.op_timeout / 4, 0.05)) if self.op_timeout else 1.0
            self._sweeper = self._loop.call_later(period, _sweep_ref, weakref.ref(self))

    def _sweep(self) -> None:
        """Frees large messages whose sender went quiet for op_timeout (a dead sender's
        partial message), then lets waiting ones in."""
        self._sweeper = None
        if self._closed:
            return
        limit = self.op_timeout or 20.0
        now = time.monotonic()
        for key, p in list(self._partials.items()):
            if now - p.last > limit:
                del self._partials[key]
                if p.waiter is None:
                    self._reserved -= p.total
                elif not p.waiter.done():  # its recv_into waits on for another message
                    self._recv_waiters.setdefault(p.tag, collections.deque()).appendleft(p.waiter)
                self._expired += 1
                self.log.warning(
                    "large message from %s (%d of %d bytes) dropped: nothing arrived for %.1f s",
                    p.sender.short(), p.got, p.total, now - p.last,
                )  # fmt: skip
        # announcements older than that: their senders have given up (op_timeout) by now
        # unless their own op_timeout is longer; granting them would only hold memory
        stale = [r for r in self._pending_rts if now - r[5] > limit]
        if stale:
            self._pending_rts = collections.deque(r for r in self._pending_rts if now - r[5] <= limit)
            self._expired += len(stale)
        self._grant_pending()
        if self._partials or self._asks or self._pending_rts:
            self._sweep_soon()

    def _message_stats(self) -> MessageStats:
        return {
            "messages_queued": self._n_queued + len(self._held_rx),
            "messages_held_back": self._held_back,  # found the queue at max_queued_messages
            "messages_dropped": self._dropped,  # ... and were dropped (queue_overflow "drop")
            "backpressure": bool(self._held_rx),  # receive buffers withheld from the provider now
            "messages_by_tag": {t: len(q) for t, q in self._inbox.items()},
            "messages_forged": self._forged,
            "messages_malformed": self._malformed,
            "messages_expired": self._expired,
            "messages_refused": self._refused,
            "large_in_progress": len(self._partials),
            "large_bytes_arrived": sum(p.got for p in self._partials.values()),
            "large_waiting": len(self._pending_rts),
            "bytes_reserved": self._reserved,
            "max_queued_bytes": self._max_queued_bytes,
            "max_queued_messages": self._max_queued,
        }

    def _fail_messages(self, exc: errors.AfabricError) -> None:
        for p in self._partials.values():
            if p.waiter is not None:
                _fail(p.waiter, exc)
        self._held_rx.clear()
        self._partials.clear()
        self._pending_rts.clear()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for ask in self._asks.values():
            _fail(ask.future, exc)
        for q in self._recv_waiters.values():
            while q:
                _fail(q.popleft(), exc)
        self._recv_waiters.clear()


def _sweep_ref(ref: weakref.ref[MessagingMixin]) -> None:
    eng = ref()  # weak: a pending sweep does not keep an engine alive
    if eng is not None:
        eng._sweep()


def _fail(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done() and not fut.get_loop().is_closed():
        fut.set_exception(exc)
        fut.exception()  # mark retrieved: nobody may await it any more


_consume: Callable[[asyncio.Future[None]], object] = lambda f: f.cancelled() or f.exception()  # noqa: E731
