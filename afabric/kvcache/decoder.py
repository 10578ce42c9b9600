"""The decode side: owns the paged KV cache, asks prefillers to fill it, and knows when a
page may be given to another request.

The cache (and the tail region, where the last hidden state or logits of each request
land) is registered once. A request allocates pages and a tail slot, takes an immediate
from ``alloc_imm``, sends the prefiller(s) where to write with ``send``, and awaits one
``expect_imm`` counting every page write of every layer plus the tail: when it resolves,
every byte is in place (an immediate is delivered only after its write's data).

Pages of a request that did not complete are reused only once no write for it can still
land: each prefiller that was asked confirms (``CONFIRM``, after all its writes for the
request completed or were disarmed, with the number of immediates they delivered; the
decoder then waits for exactly those to be counted here), or is declared dead after
``peer_timeout`` seconds without a message (a dead process writes nothing more).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import random
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..address import Address
from ..engine import Engine
from ..errors import AfabricError, InvalidArgument, OperationTimeout, UsageError
from ..memory import MemoryRegion
from . import plan, wire
from .allocator import PageAllocator
from .errors import CacheFull, RequestCancelled, RequestFailed, RequestRejected
from .layout import KvCacheLayout
from .peers import Side


class State(enum.Enum):
    PENDING = "pending"  # writes may still be landing
    DONE = "done"  # everything landed; the pages are the caller's until release()
    FAILED = "failed"
    CANCELLED = "cancelled"
    RELEASED = "released"  # pages given back


class _Rank:
    """One prefiller's part of a request."""

    __slots__ = ("address", "arrivals", "confirm", "dead", "expected")

    def __init__(self, address: bytes, expected: int) -> None:
        self.address = address
        self.expected = expected  # immediates its writes deliver when all succeed
        self.confirm: wire.Confirm | None = None
        self.dead = False
        self.arrivals: int | None = None  # delivered, once known

    @property
    def quiet(self) -> bool:
        """No write from it can still be posted."""
        return self.dead or self.confirm is not None


class DecodeRequest:
    """A request's pages and tail slot on the decoder, and the state of its transfer."""

    def __init__(
        self, dec: Decoder, rid: int, num_tokens: int, pages: npt.NDArray[np.int64], tail_slot: int | None,
        imm: int, total: int, ranks: list[_Rank],
    ) -> None:  # fmt: skip
        self._dec = dec
        self.request_id = rid
        self.num_tokens = num_tokens
        self.pages = pages
        """The cache pages holding this request's tokens, in prompt order."""
        self.tail_slot = tail_slot
        self.imm = imm
        self.payload = b""
        self.expected = total
        self.ranks = ranks
        self.state = State.PENDING
        self.error: AfabricError | None = None
        self.sent_at = time.monotonic()
        self.done_at: float | None = None
        self._landed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._expect: asyncio.Task[None] | None = None
        self._quiesced = asyncio.Event()  # all ranks quiet: safe to free after draining
        self._closing: asyncio.Task[None] | None = None

    def __repr__(self) -> str:
        return f"<DecodeRequest {self.request_id} {self.num_tokens} tokens {self.state.value}>"

    @property
    def tail(self) -> Any:
        """This request's slot of the tail region (a view of the buffer the decoder registered)."""
        if self.tail_slot is None:
            raise UsageError("the layout has no tail")
        n = self._dec.layout.tail_bytes
        return self._dec.tail_buffer[self.tail_slot * n : (self.tail_slot + 1) * n]

    async def wait(self, timeout: float | None = None) -> None:
        """Until every page and the tail landed. Raises :class:`RequestRejected`,
        :class:`RequestFailed` (a write failed, or a prefiller died), :class:`RequestCancelled`;
        ``timeout``: :class:`OperationTimeout` (the request goes on: cancel it if you give up)."""
        try:
            await asyncio.wait_for(asyncio.shield(self._landed), timeout)
        except asyncio.TimeoutError:
            raise OperationTimeout(f"request {self.request_id}: not complete after {timeout} s") from None

    async def cancel(self) -> None:
        """Stop the transfer and give the pages back once no write can still land (each
        prefiller confirmed, or died). Returns after the pages are free. After completion it
        just releases the pages."""
        if self.state in (State.DONE, State.RELEASED):
            self.release()
            return
        if self.state == State.PENDING:
            self._dec._finish(self, State.CANCELLED, RequestCancelled(f"request {self.request_id} cancelled"))
        await asyncio.shield(self._dec._start_quiesce(self))

    def release(self) -> None:
        """Give the pages of a completed request back (the caller is done with them)."""
        if self.state == State.RELEASED:
            return
        if self.state != State.DONE:
            raise UsageError(f"request {self.request_id} is {self.state.value}: cancel() it instead")
        self._dec._free(self)


class Decoder(Side):
    """The decode side of disaggregated prefill. Use as ``async with Decoder(eng, layout) as d``.

    ``cache``: the KV cache buffer (``layout.total_bytes``; numpy, torch — CPU or CUDA, if
    the provider registers it — ...), allocated on the host when omitted; ``tail``: the
    tail region (``layout.tail_region_bytes``). The decoder consumes every message the
    engine receives: give it an engine of its own."""

    def __init__(
        self,
        eng: Engine,
        layout: KvCacheLayout,
        *,
        cache: Any = None,
        tail: Any = None,
        max_write: int = 2 << 20,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        drain_timeout: float = 10.0,
        seed: int | None = None,
    ) -> None:
        if not isinstance(layout, KvCacheLayout):
            raise InvalidArgument("layout must be a KvCacheLayout")
        if max_write < layout.block_bytes:
            raise InvalidArgument(f"max_write {max_write} is smaller than one block ({layout.block_bytes} B)")
        super().__init__(
            eng, wire.DECODER, f"afabric.kvcache.decoder.{eng.name}", heartbeat_interval, peer_timeout
        )
        self.layout = layout
        self.cache = cache if cache is not None else np.zeros(layout.total_bytes, dtype=np.uint8)
        self.tail_buffer = tail if tail is not None else np.zeros(layout.tail_region_bytes, dtype=np.uint8)
        self.max_run = max(1, max_write // layout.block_bytes)
        self.drain_timeout = drain_timeout
        self.allocator = PageAllocator(layout.num_pages)
        self._free_tails = list(range(layout.tail_slots - 1, -1, -1)) if layout.tail_bytes else []
        self._rng = random.Random(seed)
        self._next_id = 0
        self._requests: dict[int, DecodeRequest] = {}
        self._mr: MemoryRegion | None = None
        self._tail_mr: MemoryRegion | None = None

    # ---- lifetime ----

    def start(self) -> None:
        """Register the cache and tail region (once) and start receiving."""
        if self._mr is not None:
            return
        self._mr = self.eng.register(self.cache)
        if self._mr.length < self.layout.total_bytes:
            raise InvalidArgument(
                f"cache of {self._mr.length} bytes, the layout needs {self.layout.total_bytes}"
            )
        if self.layout.tail_bytes:
            self._tail_mr = self.eng.register(self.tail_buffer)
            if self._tail_mr.length < self.layout.tail_region_bytes:
                raise InvalidArgument("tail region smaller than layout.tail_region_bytes")
        self._fingerprint = self.layout.fingerprint()
        self._start_loops()

    async def aclose(self) -> None:
        """Cancel what is pending (waiting, bounded, for confirmations) and stop."""
        pending = [
            r for r in self._requests.values() if r.state in (State.PENDING, State.CANCELLED, State.FAILED)
        ]
        if pending and not self.eng.closed:
            await asyncio.wait(
                [asyncio.ensure_future(r.cancel()) for r in pending],
                timeout=self.peer_timeout + self.drain_timeout,
            )
        leftover = [r._closing for r in self._requests.values() if r._closing is not None]
        await self._stop_loops(*leftover)

    # ---- requests ----

    @property
    def requests(self) -> dict[int, DecodeRequest]:
        """Requests whose pages are not free yet, by id."""
        return dict(self._requests)

    async def submit(
        self,
        prefillers: Address | bytes | Sequence[Address | bytes],
        num_tokens: int,
        payload: bytes = b"",
    ) -> DecodeRequest:
        """Allocate pages for ``num_tokens`` and ask ``prefillers`` to fill them (several:
        replicas of one cache, each writing a random, balanced share of the pages; one of
        them, at random, writes the tail). ``payload`` goes along (e.g. the token ids).
        Raises :class:`CacheFull` when pages or tail slots run out (nothing is sent)."""
        if self._mr is None:
            raise UsageError("start the decoder first (async with Decoder(...))")
        addrs = self._addresses(prefillers)
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
            raise InvalidArgument(f"num_tokens must be a positive int, got {num_tokens!r}")
        if not isinstance(payload, (bytes, bytearray)):
            raise InvalidArgument("payload must be bytes")
        tail_slot = self._take_tail()
        try:
            pages = self.allocator.alloc(self.layout.pages_for(num_tokens))
        except BaseException:
            if tail_slot is not None:
                self._free_tails.append(tail_slot)
            raise
        segs = plan.segments(pages, self.max_run)
        tail_rank = self._rng.randrange(len(addrs))
        # a prefiller with no share (a short prompt, several replicas) is not asked at all
        work = [
            (a, s, i == tail_rank and tail_slot is not None)
            for i, (a, s) in enumerate(zip(addrs, plan.split_among(segs, len(addrs), self._rng), strict=True))
        ]
        work = [(a, s, t) for a, s, t in work if s.size or t]
        ranks = [_Rank(a, plan.arrivals(self.layout, s) + (1 if t else 0)) for a, s, t in work]
        self._next_id += 1
        rid = self._next_id
        imm = self.eng.alloc_imm()
        total = sum(r.expected for r in ranks)
        req = DecodeRequest(self, rid, num_tokens, pages, tail_slot, imm, total, ranks)
        req.payload = bytes(payload)
        self._requests[rid] = req
        req._expect = asyncio.ensure_future(self.eng.expect_imm(imm, total))
        req._expect.add_done_callback(functools.partial(self._landed, req))
        me = bytes(self.eng.address)
        try:
            messages = [
                wire.encode_request(me, self._message(req, share, with_tail), self.eng.max_message_size)
                for _, share, with_tail in work
            ]
        except BaseException:
            self._requests.pop(rid, None)
            req._expect.cancel()
            self.allocator.free(pages)
            if tail_slot is not None:
                self._free_tails.append(tail_slot)
            raise
        for i, (rank, frags) in enumerate(zip(ranks, messages, strict=True)):
            try:
                for frag in frags:
                    await self.peers.send(rank.address, frag)
            except AfabricError as e:
                # It may have got part of the request (it drops it on the cancel that
                # follows, or it is dead); the ranks after it were never asked.
                for later in ranks[i + 1 :]:
                    later.dead = True
                self._finish(
                    req, State.FAILED, RequestFailed(f"request {rid}: sending to a prefiller failed: {e}")
                )
                self._start_quiesce(req)
                break
        return req

    def _message(self, req: DecodeRequest, share: npt.NDArray[np.int64], with_tail: bool) -> wire.Request:
        assert self._mr is not None and self._mr.descriptor is not None
        tail_desc = self._tail_mr.descriptor if with_tail and self._tail_mr is not None else None
        return wire.Request(
            req.request_id, self._fingerprint, self.layout.num_pages, req.num_tokens, req.imm, with_tail,
            (req.tail_slot or 0) * self.layout.tail_bytes if with_tail else 0,
            bytes(self._mr.descriptor), bytes(tail_desc) if tail_desc is not None else b"",
            share, bytes(req.payload),
        )  # fmt: skip

    def _addresses(self, prefillers: Address | bytes | Sequence[Address | bytes]) -> list[bytes]:
        seq: Sequence[Any] = (
            [prefillers] if isinstance(prefillers, (Address, bytes, bytearray)) else list(prefillers)
        )
        out = []
        for a in seq:
            addr = a if isinstance(a, Address) else Address.from_bytes(a)
            out.append(bytes(addr))
        if not out:
            raise InvalidArgument("no prefiller given")
        if len(set(out)) != len(out):
            raise InvalidArgument("the same prefiller twice in one request")
        return out

    def _take_tail(self) -> int | None:
        if not self.layout.tail_bytes:
            return None
        if not self._free_tails:
            raise CacheFull(f"all {self.layout.tail_slots} tail slots are in use")
        return self._free_tails.pop()

    # ---- completion, failure, quiescing ----

    def _landed(self, req: DecodeRequest, t: asyncio.Task[None]) -> None:
        if t.cancelled():
            return
        exc = t.exception()
        if exc is None:
            if req.state == State.PENDING:
                req.done_at = time.monotonic()
                self._finish(req, State.DONE, None)
            for r in req.ranks:  # every write landed: none can come later
                r.arrivals = r.expected
            req._quiesced.set()
        elif req.state == State.PENDING:
            err = exc if isinstance(exc, AfabricError) else RequestFailed(str(exc))
            self._finish(req, State.FAILED, err)
            self._start_quiesce(req)

    def _finish(self, req: DecodeRequest, state: State, err: AfabricError | None) -> None:
        """PENDING -> DONE / FAILED / CANCELLED (once); wakes wait()."""
        if req.state != State.PENDING:
            return
        req.state = state
        req.error = err
        if err is None:
            req._landed.set_result(None)
        else:
            req._landed.set_exception(err)
            req._landed.exception()  # nobody need await it
        if state != State.DONE:
            for r in req.ranks:
                if not r.quiet:
                    self.peers.post(
                        r.address, wire.encode_cancel(bytes(self.eng.address), req.request_id), "cancel"
                    )

    def _start_quiesce(self, req: DecodeRequest) -> asyncio.Task[None]:
        if req._closing is None:
            req._closing = asyncio.ensure_future(self._quiesce(req))
        return req._closing

    async def _quiesce(self, req: DecodeRequest) -> None:
        """Wait until no write of ``req`` can land any more, then free its pages."""
        if req.state == State.RELEASED:
            return
        self._check_quiet(req)
        await req._quiesced.wait()
        await self._drain(req)
        self._free(req)

    def _check_quiet(self, req: DecodeRequest) -> None:
        if all(r.quiet for r in req.ranks):
            req._quiesced.set()

    async def _drain(self, req: DecodeRequest) -> None:
        """Consume exactly the immediates the confirmed writes delivered (each comes after
        its data: once counted, that data is in place), so nothing stale is left counted."""
        expect = req._expect
        if expect is not None and expect.done() and not expect.cancelled() and expect.exception() is None:
            return  # everything landed and was consumed
        known = [r.arrivals for r in req.ranks]
        if any(a is None for a in known):
            # a dead prefiller or a failed write: how many immediates landed is unknowable;
            # a dead process writes nothing more, so the pages are safe, the count is dropped
            if expect is not None and not expect.done():
                expect.cancel()
            return
        landed = sum(a for a in known if a is not None)
        if expect is not None and not expect.done():
            if landed >= req.expected:
                with contextlib.suppress(AfabricError, asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(expect), self.drain_timeout)
                if expect.done():
                    return
            expect.cancel()  # cannot complete: fewer than `expected` will ever come
            with contextlib.suppress(asyncio.CancelledError, AfabricError):
                await expect
        if landed:
            try:
                await self.eng.expect_imm(req.imm, landed, timeout=self.drain_timeout)
            except AfabricError as e:
                self.log.warning(
                    "request %d: %d immediates confirmed did not all arrive: %s", req.request_id, landed, e
                )

    def _free(self, req: DecodeRequest) -> None:
        if req.state == State.RELEASED:
            return
        req.state = State.RELEASED
        self._requests.pop(req.request_id, None)
        self.allocator.free(req.pages)
        if req.tail_slot is not None:
            self._free_tails.append(req.tail_slot)

    # ---- messages ----

    def _handle(self, m: wire.Message) -> None:
        if isinstance(m, wire.Confirm):
            self._on_confirm(m)
        elif not isinstance(m, wire.Heartbeat):
            self._bad(f"a decoder does not take {type(m).__name__} messages")

    def _on_confirm(self, m: wire.Confirm) -> None:
        req = self._requests.get(m.request_id)
        rank = next((r for r in req.ranks if r.address == m.sender), None) if req else None
        if req is None or rank is None:
            self.log.info("confirmation for unknown request %d", m.request_id)
            return
        rank.confirm = m
        rank.arrivals = None if m.arrivals == wire.ARRIVALS_UNKNOWN else int(m.arrivals)
        if rank.arrivals is not None and rank.arrivals > rank.expected:
            self._bad(f"request {m.request_id}: {rank.arrivals} arrivals confirmed, {rank.expected} possible")
            rank.arrivals = None
        if m.status == wire.REJECTED:
            self._finish(
                req,
                State.FAILED,
                RequestRejected(f"request {m.request_id}: prefiller refused it: {m.reason}"),
            )
        elif m.status in (wire.FAILED, wire.UNKNOWN) or (
            m.status == wire.CANCELLED and req.state == State.PENDING
        ):
            what = wire.STATUS_NAMES[m.status]
            self._finish(
                req,
                State.FAILED,
                RequestFailed(f"request {m.request_id}: prefiller reports {what}: {m.reason}"),
            )
        if req.state != State.PENDING:
            self._start_quiesce(req)
        self._check_quiet(req)

    def _tick(self) -> None:
        """Heartbeats to prefillers with work for us; declare silent ones dead."""
        live: set[bytes] = set()
        for req in list(self._requests.values()):
            for r in req.ranks:
                if r.quiet or (req.state == State.DONE and req._quiesced.is_set()):
                    continue
                if self.peers.silent_for(r.address, req.sent_at) > self.peer_timeout:
                    r.dead = True
                    self.log.warning(
                        "request %d: prefiller %s silent for %.1f s: declared dead",
                        req.request_id, r.address.hex()[:16], self.peer_timeout,
                    )  # fmt: skip
                    self._finish(req, State.FAILED, RequestFailed(
                        f"request {req.request_id}: prefiller silent for {self.peer_timeout} s (dead)"
                    ))  # fmt: skip
                    self._start_quiesce(req)
                    self._check_quiet(req)
                else:
                    live.add(r.address)
        self.peers.beat(live)
