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

Pull mode (``submit(..., mode="pull")``): the prefillers write nothing; each computes its
share into its staging pages, holds them and sends ``READY`` with where they are; the
decoder reads them into the request's pages (``read_paged``, one call per layer and run
length, plus the tail) and then sends ``RELEASE`` so the prefiller may reuse them (also
after a failed read, and ``CANCEL`` when the request ends early). The pages of a pulled
request are freed once none of its reads is still in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import random
import secrets
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from ..address import Address
from ..descriptor import MrDesc
from ..engine import Engine
from ..errors import AfabricError, InvalidArgument, OperationTimeout, UsageError
from ..hostmem import host_buffer
from ..memory import MemoryRegion
from ..pages import Pages
from . import plan, wire
from .allocator import PageAllocator
from .errors import CacheFull, ProtocolError, RequestCancelled, RequestFailed, RequestRejected
from .layout import KvCacheLayout
from .peers import Side


class State(enum.Enum):
    """Where a decode request is (``DecodeRequest.state``)."""

    PENDING = "pending"  # writes may still be landing
    DONE = "done"  # everything landed; the pages are the caller's until release()
    FAILED = "failed"
    CANCELLED = "cancelled"
    RELEASED = "released"  # pages given back


class _Rank:
    """One prefiller's part of a request."""

    __slots__ = (
        "address", "arrivals", "confirm", "dead", "expected", "pull", "reading", "released", "share", "tail",
    )  # fmt: skip

    def __init__(
        self, address: bytes, expected: int, pull: bool = False, share: Any = None, tail: bool = False
    ) -> None:
        self.address = address
        self.expected = expected  # immediates its writes deliver when all succeed
        self.confirm: wire.Confirm | None = None
        self.dead = False
        self.arrivals: int | None = 0 if pull else None  # delivered, once known (pull: none)
        self.pull = pull
        self.share = share  # pull: its segments (pos, dst, count)
        self.tail = tail  # pull: it holds the tail
        self.reading: asyncio.Task[None] | None = None  # pull: the reads of its pages
        self.released = False  # pull: RELEASE (or CANCEL) sent after READY

    @property
    def quiet(self) -> bool:
        """Nothing from it can still land in the request's pages (push: no write of it can
        still be posted; pull: none of its reads is in flight)."""
        if self.pull:
            return self.reading is None or self.reading.done()
        return self.dead or self.confirm is not None

    @property
    def settled(self) -> bool:
        """Nothing more is expected from it (push: quiet; pull: its pages were released,
        or it confirmed an end, or it is dead)."""
        if self.pull:
            return self.dead or self.released or self.confirm is not None
        return self.quiet


def _pull_mode(mode: str) -> bool:
    if mode not in ("push", "pull"):
        raise InvalidArgument(f"mode must be 'push' or 'pull', got {mode!r}")
    return mode == "pull"


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
        self.mode = "pull" if ranks and ranks[0].pull else "push"

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
        """Wait until every page and the tail landed.

        Args:
            timeout: seconds; None waits for ever. The request goes on after a timeout: cancel
                it if you give up.

        Raises:
            RequestRejected: the prefiller refused the request.
            RequestFailed: a write or read failed, or a prefiller died or fell silent.
            RequestCancelled: the request was cancelled.
            OperationTimeout: ``timeout`` passed first.
        """
        try:
            await asyncio.wait_for(asyncio.shield(self._landed), timeout)
        except asyncio.TimeoutError:
            raise OperationTimeout(f"request {self.request_id}: not complete after {timeout} s") from None

    async def cancel(self) -> None:
        """Stop the transfer and give the pages back once no write can still land.

        Each prefiller confirms how many immediates its writes delivered (or is found dead) and
        this waits for exactly those; after completion it just releases the pages. Returns after
        the pages are free.
        """
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

    The decoder consumes every message the engine receives: give it an engine of its own.

    Args:
        eng: the decoder's engine.
        layout: the KV cache's geometry.
        cache: the KV cache buffer (``layout.total_bytes``: numpy, torch on CPU or CUDA where
            the provider registers it), allocated with ``afabric.host_buffer`` when omitted.
        tail: the tail region (``layout.tail_region_bytes``), allocated when omitted.
        max_write: the largest write a run of consecutive pages becomes.
        heartbeat_interval: seconds between heartbeats to prefillers with requests.
        peer_timeout: seconds of silence after which a prefiller's requests fail.
        drain_timeout: seconds ``aclose`` waits for requests in flight.
        seed: seeds the random deal of pages to replicas.

    Raises:
        InvalidArgument: a buffer of the wrong size or kind.
        RegistrationError: the engine's provider cannot register the cache.
    """

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
        # host_buffer: peers' same-host copies (cma) into (and out of) huge pages, 2-3x faster
        self.cache = cache if cache is not None else host_buffer(layout.total_bytes)
        self.tail_buffer = tail if tail is not None else host_buffer(layout.tail_region_bytes)
        self.max_run = max(1, max_write // layout.block_bytes)
        self.drain_timeout = drain_timeout
        self.allocator = PageAllocator(layout.num_pages)
        self._free_tails = list(range(layout.tail_slots - 1, -1, -1)) if layout.tail_bytes else []
        self._rng = random.Random(seed)
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
        *,
        mode: str = "push",
    ) -> DecodeRequest:
        """Allocate pages for ``num_tokens`` and ask ``prefillers`` to fill them.

        Args:
            prefillers: one prefiller's address, or several: replicas of one cache, each writing
                a random, balanced share of the pages; one of them, at random, writes the tail.
            num_tokens: the prompt's length.
            payload: bytes sent along (e.g. the token ids).
            mode: ``"push"`` (the prefillers write each layer as it is computed) or ``"pull"``
                (they hold the computed pages; this side reads them, then releases them).

        Returns:
            The request: ``await req.wait()``, then ``req.release()``.

        Raises:
            CacheFull: pages or tail slots ran out (nothing is sent).
            InvalidArgument: a bad address, token count, payload or mode.
            UsageError: the decoder was not started (``async with``).
        """
        if self._mr is None:
            raise UsageError("start the decoder first (async with Decoder(...))")
        pull = _pull_mode(mode)
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
        ranks = [self._rank(a, s, t, pull) for a, s, t in work]
        rid = self._new_id()
        imm = self.eng.alloc_imm()
        total = sum(r.expected for r in ranks)
        req = DecodeRequest(self, rid, num_tokens, pages, tail_slot, imm, total, ranks)
        req.payload = bytes(payload)
        req.mode = "pull" if pull else "push"
        self._requests[rid] = req
        self._expect_writes(req)
        me = bytes(self.eng.address)
        try:
            messages = [
                wire.encode_request(me, self._message(req, share, with_tail), self.eng.max_message_size)
                for _, share, with_tail in work
            ]
        except BaseException:
            self._requests.pop(rid, None)
            if req._expect is not None:
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

    def _new_id(self) -> int:
        """64 random bits, none of a request still here: a peer cannot guess the id of
        another decoder's request (``seed`` drives only the split among prefillers)."""
        while True:
            rid = secrets.randbits(64)
            if rid not in self._requests:
                return rid

    def _expect_writes(self, req: DecodeRequest) -> None:
        """Push: one expectation counts every write's immediate (pull: reads are awaited)."""
        if req.mode == "push":
            req._expect = asyncio.ensure_future(self.eng.expect_imm(req.imm, req.expected))
            req._expect.add_done_callback(functools.partial(self._landed, req))

    def _rank(self, addr: bytes, share: npt.NDArray[np.int64], tail: bool, pull: bool) -> _Rank:
        if pull:
            return _Rank(addr, 0, True, share, tail)
        return _Rank(addr, plan.arrivals(self.layout, share) + (1 if tail else 0))

    def _message(self, req: DecodeRequest, share: npt.NDArray[np.int64], with_tail: bool) -> wire.Request:
        pull = req.mode == "pull"
        assert self._mr is not None and self._mr.descriptor is not None
        tail_desc = self._tail_mr.descriptor if with_tail and self._tail_mr is not None else None
        return wire.Request(
            req.request_id, self._fingerprint, self.layout.num_pages, req.num_tokens, req.imm, with_tail,
            (req.tail_slot or 0) * self.layout.tail_bytes if with_tail else 0,
            bytes(self._mr.descriptor), bytes(tail_desc) if tail_desc is not None else b"",
            share, bytes(req.payload), pull,
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
                if not r.settled:
                    r.released = r.pull
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
        elif isinstance(m, wire.Ready):
            self._on_ready(m)
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
                if r.settled or (req.state == State.DONE and req._quiesced.is_set()):
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

    # ---- pull mode ----

    def _on_ready(self, m: wire.Ready) -> None:
        req = self._requests.get(m.request_id)
        rank = next((r for r in req.ranks if r.address == m.sender), None) if req else None
        ended = rank is not None and rank.pull and req is not None and req.state != State.PENDING
        if req is None or (ended and rank is not None and not rank.released):
            # a request that ended before its pages were ready: let the prefiller reuse them
            if rank is not None:
                rank.released = True
            self._release_pages(m.sender, m.request_id)
            return
        if rank is None or not rank.pull:
            self._bad(f"ready for request {m.request_id} from a peer that was not asked to hold it")
            return
        if rank.reading is not None or rank.released:
            self._bad(f"ready for request {m.request_id} twice")
            return
        try:
            src, tail = wire.check_ready(m, self.layout, self.layout.pages_for(req.num_tokens), rank.tail)
        except ProtocolError as e:
            self._bad(str(e))
            rank.released = True
            self._release_pages(m.sender, m.request_id)
            self._finish(req, State.FAILED, RequestFailed(f"request {m.request_id}: bad ready: {e}"))
            self._start_quiesce(req)
            return
        rank.reading = asyncio.ensure_future(self._pull(req, rank, m, src, tail))
        rank.reading.add_done_callback(functools.partial(self._pulled, req, rank))

    def _release_pages(self, prefiller: bytes, rid: int) -> None:
        self.peers.post(prefiller, wire.encode_release(bytes(self.eng.address), rid), "release")

    async def _pull(
        self, req: DecodeRequest, rank: _Rank, m: wire.Ready, src: MrDesc, tail: MrDesc | None
    ) -> None:
        """Read this rank's share (every layer, then the tail) into the request's pages;
        waits for every read it posted, then raises the first failure."""
        assert self._mr is not None
        lay = self.layout
        bb = lay.block_bytes
        staging = lay.with_pages(m.staging_pages)
        reads: list[Any] = []
        for layer in range(lay.num_layers):
            for pr in plan.layer_writes(staging, lay, layer, rank.share, m.first_page):
                reads.append(self.eng.read_paged(
                    self._mr, src, page_len=pr.page_len, src_pages=Pages(pr.src_idx, bb),
                    dst_pages=Pages(pr.dst_idx, bb),
                ))  # fmt: skip
        if tail is not None and self._tail_mr is not None and req.tail_slot is not None:
            reads.append(self.eng.read(
                self._tail_mr, tail, lay.tail_bytes, src_offset=m.tail_offset,
                dst_offset=req.tail_slot * lay.tail_bytes,
            ))  # fmt: skip
        results = await asyncio.gather(*reads, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def _pulled(self, req: DecodeRequest, rank: _Rank, t: asyncio.Task[None]) -> None:
        if not rank.released:
            rank.released = True
            self._release_pages(rank.address, req.request_id)
        exc = BaseException("cancelled") if t.cancelled() else t.exception()
        if exc is not None:
            self._finish(req, State.FAILED, RequestFailed(
                f"request {req.request_id}: reading from a prefiller failed: {type(exc).__name__}: {exc}"
            ))  # fmt: skip
            self._start_quiesce(req)
        elif req.state == State.PENDING and all(
            r.reading is not None and r.reading.done() and not r.reading.cancelled()
            and r.reading.exception() is None for r in req.ranks
        ):  # fmt: skip
            req.done_at = time.monotonic()
            self._finish(req, State.DONE, None)
        self._check_quiet(req)
