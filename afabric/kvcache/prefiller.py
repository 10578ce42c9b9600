"""The prefill side: takes requests, lets the model compute them into a staging cache, and
lands each layer in the decoder's pages as soon as it is computed.

A prefiller has one *layer clock*: a UVM watcher that the model bumps once per finished
layer (and once for the tail), requests being computed one after another. When a job
starts, every paged write of every layer is handed to the shim at once, armed on the clock
value at which its layer is done (``when=watcher.reaches(base + layer + 1)``); the shim
posts each the moment the model's bump lands, with no Python in between, then the tail.

Cancelling (the decoder's ``CANCEL``, a failed write, a dead decoder) stops the job's
bumps, disarms the writes of the layers not bumped yet — the clock cannot reach their
values before the disarm is queued, because the next job starts only after that — lets
the fired ones finish, and then confirms to the decoder how many immediates landed.

Pull mode (a request with ``FLAG_PULL``): nothing is armed; once the model signalled every
step, the job is *held*: its staging pages (and tail slot) stay the decoder's, a ``READY``
tells it where they are (the staging cache is registered ``remote="r"``), and they are
reused only after the decoder's ``RELEASE`` or ``CANCEL``, or once the decoder is declared
dead (``peer_timeout`` without a message).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import functools
import threading
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np

from ..engine import Engine
from ..errors import AfabricError, InvalidArgument, RegistrationError, UsageError
from ..hostmem import host_buffer
from ..memory import MemoryRegion
from ..pages import Pages
from . import plan, wire
from .allocator import PageAllocator
from .bump import Bumper
from .errors import CacheFull, ProtocolError, RequestCancelled
from .layout import KvCacheLayout
from .peers import Side

Key = tuple[bytes, int]  # (decoder address, request id)

_RECENT = 65536  # finished, cancelled or refused requests remembered (late cancels, replays)
_MAX_PARTIAL_BYTES = 256 << 20  # request fragments held while reassembling, all decoders


class JobState(enum.Enum):
    """Where a prefill job is (``PrefillJob.state``)."""

    WAITING = "waiting"  # accepted, waiting for staging pages
    QUEUED = "queued"  # has pages, waiting for the model
    COMPUTING = "computing"
    WRITING = "writing"  # computed; fired writes finishing
    HELD = "held"  # pull mode: computed; the pages wait for the decoder to read and release them
    FINISHED = "finished"


@dataclass
class _Step:
    step: int  # fires when the clock reaches base + step + 1
    task: asyncio.Task[None]
    arrivals: int


@dataclass
class _Assembly:
    frag: wire.Fragment
    chunks: dict[int, bytes]
    started: float


class PrefillJob:
    """One request on the prefiller. Compute it inside ``async with job:`` (which arms its
    writes and holds the layer clock), storing layer ``l``'s KV into the staging cache at
    pages ``first_page .. first_page + prompt_pages - 1`` and calling :meth:`layer_done`
    after each layer, then filling :attr:`tail` and calling :meth:`tail_done`."""

    def __init__(self, pf: Prefiller, key: Key, req: wire.Request, checked: wire.Checked) -> None:
        self._pf = pf
        self.key = key
        self.decoder = key[0]
        self.request = req
        self.request_id = req.request_id
        self.num_tokens = req.num_tokens
        self.payload = req.payload
        self.prompt_pages = checked.prompt_pages
        self.checked = checked
        self.dst_layout = pf.layout.with_pages(req.num_pages)
        self.first_page = -1
        self.tail_slot: int | None = None
        self.state = JobState.WAITING
        self.steps = pf.layout.num_layers + (1 if pf.layout.tail_bytes else 0)
        self.base = 0
        self.bumped = 0
        self.cancel_requested = False
        self.decoder_dead = False
        self.failure: str | None = None
        self._lock = threading.Lock()
        self._stopped = False
        self._writes: list[_Step] = []
        self.t_begin = 0.0
        self.t_computed = 0.0

    def __repr__(self) -> str:
        return f"<PrefillJob {self.request_id} {self.num_tokens} tokens {self.state.value}>"

    @property
    def cancelled(self) -> bool:
        """The job was stopped (cancelled, a write failed, the decoder died): stop computing."""
        return self._stopped

    @property
    def tail(self) -> Any:
        """This job's slot of the staging tail buffer: fill it before :meth:`tail_done`."""
        if self.tail_slot is None:
            raise UsageError("the layout has no tail")
        n = self._pf.layout.tail_bytes
        return self._pf.tail_buffer[self.tail_slot * n : (self.tail_slot + 1) * n]

    # ---- the model's side (any thread) ----

    def layer_done(self) -> None:
        """The current layer's KV is in the staging cache: release its writes.

        "In" includes queued to be, on the current stream.

        Raises:
            RequestCancelled: the job was stopped (nothing more is released).
        """
        with self._lock:
            if self._stopped:
                raise RequestCancelled(
                    f"request {self.request_id} was stopped: {self.failure or 'cancelled'}"
                )
            if self.state != JobState.COMPUTING:
                raise UsageError("layer_done() outside `async with job:`")
            if self.bumped >= self.steps:
                raise UsageError(f"request {self.request_id}: {self.steps} steps already signalled")
            self._pf._bump()
            self.bumped += 1
            self._pf._clock += 1

    def tail_done(self) -> None:
        """The tail is in ``tail``: release its write (the last step).

        Raises:
            RequestCancelled: the job was stopped.
        """
        if self.bumped != self.steps - 1 or self.tail_slot is None:
            raise UsageError(f"tail_done() after {self.bumped} of {self.steps - 1} layers (or no tail)")
        self.layer_done()

    # ---- the loop's side ----

    async def __aenter__(self) -> PrefillJob:
        await self._pf._begin(self)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        return await self._pf._end(self, exc)

    def _stop(self, why: str) -> None:
        """No more bumps for this job; disarm the writes of the steps not bumped."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                self.failure = self.failure or why
            fired = self.bumped
        for s in self._writes:
            if s.step >= fired and not s.task.done():
                s.task.cancel()


class Prefiller(Side):
    """The prefill side. Use as ``async with``; it consumes every message its engine receives.

    Args:
        eng: the prefiller's engine.
        layout: the model's geometry with this prefiller's staging page count.
        cache: the staging cache (``layout.total_bytes``); host memory when omitted, or a
            CUDA tensor on ``device``.
        tail: the staging tail region (``layout.tail_region_bytes``).
        device: the CUDA device whose stream bumps the layer clock (None: the host bumps it).
        heartbeat_interval: seconds between heartbeats to decoders with jobs.
        peer_timeout: seconds of silence after which a decoder's jobs are stopped.
        max_waiting: requests kept waiting for staging pages.
        pull: serve pull-mode requests, which registers the staging buffers ``remote="r"``
            (any peer given their descriptor may read all of them); with False they are not
            remotely accessible and pull requests are refused.

    Raises:
        InvalidArgument: a buffer of the wrong size or kind.
        RegistrationError: the engine's provider cannot register the staging cache.
    """

    def __init__(
        self,
        eng: Engine,
        layout: KvCacheLayout,
        *,
        cache: Any = None,
        tail: Any = None,
        device: int | None = None,
        heartbeat_interval: float = 0.5,
        peer_timeout: float = 10.0,
        max_waiting: int = 4096,
        pull: bool = True,
    ) -> None:
        if not isinstance(layout, KvCacheLayout):
            raise InvalidArgument("layout must be a KvCacheLayout")
        super().__init__(
            eng, wire.PREFILLER, f"afabric.kvcache.prefiller.{eng.name}", heartbeat_interval, peer_timeout
        )
        self.layout = layout
        self.device = device
        # host_buffer: peers' same-host copies (cma) into (and out of) huge pages, 2-3x faster
        self.cache = cache if cache is not None else host_buffer(layout.total_bytes)
        self.tail_buffer = tail if tail is not None else host_buffer(layout.tail_region_bytes)
        self.max_waiting = max_waiting
        self.pull = pull
        self.max_tokens = layout.num_pages * layout.tokens_per_page
        self.allocator = PageAllocator(layout.num_pages)
        self._free_tails = list(range(layout.tail_slots - 1, -1, -1)) if layout.tail_bytes else []
        self._fingerprint = layout.fingerprint()
        self._jobs: dict[Key, PrefillJob] = {}
        self._waiting: collections.deque[PrefillJob] = collections.deque()
        self._ready: collections.deque[PrefillJob] = collections.deque()
        self._ready_event = asyncio.Event()
        self._partial: dict[Key, _Assembly] = {}
        self._partial_bytes = 0
        self._recent: collections.OrderedDict[Key, tuple[int, int, str]] = collections.OrderedDict()
        self._clock = 0
        self._clock_lock = asyncio.Lock()
        self._mr: MemoryRegion | None = None
        self._tail_mr: MemoryRegion | None = None
        self._bump: Callable[[], None] = lambda: None
        self.stats = collections.Counter[str]()

    # ---- lifetime ----

    def start(self) -> None:
        if self._mr is not None:
            return
        self._mr = self._register(self.cache)
        if self._mr.length < self.layout.total_bytes:
            raise InvalidArgument(
                f"staging cache of {self._mr.length} bytes, the layout needs {self.layout.total_bytes}"
            )
        if self.layout.tail_bytes:
            self._tail_mr = self._register(self.tail_buffer)
        self.watcher = self.eng.uvm_watcher(self.device)
        self._bump = Bumper(self.watcher)
        self._start_loops()

    def _register(self, buf: Any) -> MemoryRegion:
        """Readable by peers when serving pulls; where the provider cannot register memory
        for remote reads (a provider library from before reads), pull mode is turned off
        and push requests are served as before."""
        if self.pull:
            try:
                return self.eng.register(buf, remote="r")
            except RegistrationError as e:
                self.log.info("staging cache not readable by peers (%s): pull requests are refused", e)
                self.pull = False
                if self._mr is not None:  # the cache is registered readable, the tail not
                    self.eng.deregister(self._mr)
                    self._mr = self.eng.register(self.cache, remote=False)
        return self.eng.register(buf, remote=False)

    async def aclose(self) -> None:
        """Stop every job (disarming what has not fired), wait (bounded) for fired writes."""
        for job in list(self._jobs.values()):
            if job.state in (JobState.WAITING, JobState.QUEUED):
                self._drop_unstarted(job, wire.CANCELLED, "prefiller closing")
            elif job.state == JobState.HELD:
                self._unhold(job, wire.CANCELLED, "prefiller closing")
            else:
                job._stop("prefiller closing")
        writes = [s.task for j in self._jobs.values() for s in j._writes if not s.task.done()]
        if writes and not self.eng.closed:
            await asyncio.wait(writes, timeout=self.eng.op_timeout or None)
        await self._stop_loops()

    # ---- jobs ----

    async def next_job(self) -> PrefillJob:
        """The next request with staging pages, in arrival order.

        Returns:
            The job: compute it inside ``async with job:``.
        """
        while not self._ready:
            self._ready_event.clear()
            await self._ready_event.wait()
        return self._ready.popleft()

    async def jobs(self) -> AsyncIterator[PrefillJob]:
        while True:
            yield await self.next_job()

    async def serve(self, compute: Callable[[PrefillJob], Awaitable[None]]) -> None:
        """Compute jobs one after another for ever: ``async with job: await compute(job)``.

        A job stopped meanwhile ends quietly; a model error fails that job (logged).

        Args:
            compute: the model's prefill of one job.
        """
        while True:
            job = await self.next_job()
            try:
                async with job:
                    await compute(job)
            except RequestCancelled as e:
                self.log.info("request %d: %s", job.request_id, e)
            except AfabricError as e:
                self.log.warning("request %d failed: %s", job.request_id, e)
            except Exception:
                self.log.exception("request %d: the model failed", job.request_id)

    @property
    def active(self) -> dict[Key, PrefillJob]:
        """Jobs not finished yet (waiting, queued, computing or writing)."""
        return dict(self._jobs)

    async def _begin(self, job: PrefillJob) -> None:
        if job._stopped:
            raise RequestCancelled(f"request {job.request_id} was stopped: {job.failure}")
        if job.state != JobState.QUEUED:
            raise UsageError(f"request {job.request_id} is {job.state.value}, not queued")
        await self._clock_lock.acquire()
        try:
            if job._stopped:
                raise RequestCancelled(f"request {job.request_id} was stopped: {job.failure}")
            job.state = JobState.COMPUTING
            job.base = self._clock
            job.t_begin = time.monotonic()
            self._arm(job)
            await asyncio.sleep(0)  # the write tasks run up to their await: armed in the shim
        except BaseException:
            job.state = JobState.WRITING
            self._clock_lock.release()
            job._stop("could not arm the writes")
            self._maybe_finish(job)
            raise

    def _arm(self, job: PrefillJob) -> None:
        assert self._mr is not None
        if job.request.pull:
            return  # the decoder reads the pages once they are all computed
        lay, req, imm = self.layout, job.request, job.request.imm
        bb = lay.block_bytes
        desc = job.checked.cache
        for layer in range(lay.num_layers):
            when = self.watcher.reaches(job.base + layer + 1)
            for pw in plan.layer_writes(lay, job.dst_layout, layer, req.segments, job.first_page):
                coro = self.eng.write_paged(
                    self._mr, desc, page_len=pw.page_len, src_pages=Pages(pw.src_idx, bb),
                    dst_pages=Pages(pw.dst_idx, bb), imm=imm, when=when,
                )  # fmt: skip
                self._track(job, layer, coro, len(pw.src_idx))
        if req.write_tail and job.checked.tail is not None and self._tail_mr is not None:
            assert job.tail_slot is not None
            coro = self.eng.write(
                self._tail_mr, job.checked.tail, lay.tail_bytes, src_offset=job.tail_slot * lay.tail_bytes,
                dst_offset=req.tail_offset, imm=imm, when=self.watcher.reaches(job.base + lay.num_layers + 1),
            )  # fmt: skip
            self._track(job, lay.num_layers, coro, 1)

    def _track(self, job: PrefillJob, step: int, coro: Awaitable[None], arrivals: int) -> None:
        task = asyncio.ensure_future(coro)
        job._writes.append(_Step(step, task, arrivals))
        task.add_done_callback(functools.partial(self._write_done, job))

    async def _end(self, job: PrefillJob, exc: BaseException | None) -> bool:
        """Leaving ``async with job``: disarm what was not bumped, hand the clock on."""
        suppress = isinstance(exc, RequestCancelled) and job._stopped
        short: UsageError | None = None
        try:
            if exc is not None and not suppress:
                job._stop(f"the model failed: {type(exc).__name__}: {exc}")
            elif exc is None and job.bumped < job.steps and not job._stopped:
                job._stop(f"the model signalled {job.bumped} of {job.steps} steps")
                short = UsageError(f"request {job.request_id}: {job.bumped} of {job.steps} steps signalled")
            unfired = [s.task for s in job._writes if s.step >= job.bumped]
            if unfired:  # their cancel requests are queued in the shim before any later bump
                await asyncio.gather(*unfired, return_exceptions=True)
        finally:
            job.t_computed = time.monotonic()
            job.state = JobState.WRITING
            self._clock_lock.release()
            self._maybe_finish(job)
        if short is not None:
            raise short
        return suppress

    def _write_done(self, job: PrefillJob, t: asyncio.Task[None]) -> None:
        if not t.cancelled() and t.exception() is not None:
            job._stop(f"a write failed: {t.exception()}")
        self._maybe_finish(job)

    def _maybe_finish(self, job: PrefillJob) -> None:
        if job.state != JobState.WRITING or not all(s.task.done() for s in job._writes):
            return
        if job.request.pull:
            self._pull_computed(job)
            return
        job.state = JobState.FINISHED
        arrivals: int = 0
        for s in job._writes:
            if s.task.cancelled():
                continue
            if s.task.exception() is not None:
                arrivals = wire.ARRIVALS_UNKNOWN
                break
            arrivals += s.arrivals
        total = sum(s.arrivals for s in job._writes)
        if arrivals == total and not job._stopped:
            status, reason = wire.DONE, ""
        elif job.cancel_requested:
            status, reason = (wire.DONE if arrivals == total else wire.CANCELLED), "cancelled"
        else:
            status, reason = wire.FAILED, job.failure or "failed"
        self.stats[wire.STATUS_NAMES[status]] += 1
        if status == wire.DONE:
            self.stats["pages_written"] += job.request.pages
        self._release(job)
        self._remember(job.key, status, arrivals, reason)
        if status != wire.DONE or job.cancel_requested:
            self._confirm(job.key, status, arrivals, reason, job.decoder_dead)

    def _pull_computed(self, job: PrefillJob) -> None:
        """A pull job left the model: hold its pages and tell the decoder, or (stopped)
        give them back at once (nothing was shown to the decoder)."""
        if job._stopped:
            job.state = JobState.FINISHED
            status = wire.CANCELLED if job.cancel_requested else wire.FAILED
            self.stats[wire.STATUS_NAMES[status]] += 1
            reason = "cancelled" if job.cancel_requested else job.failure or "failed"
            self._release(job)
            self._remember(job.key, status, 0, reason)
            self._confirm(job.key, status, 0, reason, job.decoder_dead)
            return
        assert self._mr is not None and self._mr.descriptor is not None
        job.state = JobState.HELD
        self.stats["ready"] += 1
        tail = b""
        offset = 0
        if job.request.write_tail and self._tail_mr is not None and self._tail_mr.descriptor is not None:
            assert job.tail_slot is not None
            tail, offset = bytes(self._tail_mr.descriptor), job.tail_slot * self.layout.tail_bytes
        msg = wire.encode_ready(
            bytes(self.eng.address), job.request_id, self.layout.num_pages, job.first_page,
            bytes(self._mr.descriptor), tail, offset,
        )  # fmt: skip
        task = asyncio.ensure_future(self.peers.send(job.decoder, msg))
        task.add_done_callback(functools.partial(self._ready_sent, job))

    def _ready_sent(self, job: PrefillJob, t: asyncio.Task[None]) -> None:
        err = None if t.cancelled() else t.exception()
        if (t.cancelled() or err is not None) and job.state == JobState.HELD:
            self.peers.send_failures += 1
            self._unhold(job, wire.FAILED, f"sending ready failed: {err or 'cancelled'}")

    def _unhold(self, job: PrefillJob, status: int, reason: str) -> None:
        """A held pull job ends: its pages are free again (released by the decoder, or the
        decoder cancelled or is dead, or this side is closing)."""
        if job.state != JobState.HELD:
            return
        job.state = JobState.FINISHED
        self.stats[wire.STATUS_NAMES[status]] += 1
        if status == wire.DONE:
            self.stats["pages_read"] += job.request.pages
        self._release(job)
        self._remember(job.key, status, 0, reason)
        if status != wire.DONE:
            self._confirm(job.key, status, 0, reason, job.decoder_dead)

    def _release(self, job: PrefillJob) -> None:
        self._jobs.pop(job.key, None)
        if job.first_page >= 0:
            self.allocator.free(np.arange(job.first_page, job.first_page + job.prompt_pages))
            job.first_page = -1
        if job.tail_slot is not None:
            self._free_tails.append(job.tail_slot)
            job.tail_slot = None
        self._admit()

    def _drop_unstarted(self, job: PrefillJob, status: int, reason: str) -> None:
        """Forget a job that never armed anything (nothing of it can land)."""
        with contextlib.suppress(ValueError):
            self._waiting.remove(job)
        with contextlib.suppress(ValueError):
            self._ready.remove(job)
        job._stop(reason)
        job.state = JobState.FINISHED
        self._release(job)
        self._remember(job.key, status, 0, reason)
        self._confirm(job.key, status, 0, reason, job.decoder_dead)

    def _remember(self, key: Key, status: int, arrivals: int, reason: str) -> None:
        self._recent[key] = (status, arrivals, reason)
        self._recent.move_to_end(key)
        while len(self._recent) > _RECENT:
            self._recent.popitem(last=False)

    def _confirm(self, key: Key, status: int, arrivals: int, reason: str, dead: bool = False) -> None:
        if dead:
            return
        msg = wire.encode_confirm(bytes(self.eng.address), key[1], status, arrivals, reason)
        self.peers.post(key[0], msg, f"confirm {wire.STATUS_NAMES[status]}")

    # ---- admission: staging pages ----

    def _admit(self) -> None:
        """Give staging pages to waiting requests, oldest first."""
        while self._waiting:
            job = self._waiting[0]
            try:
                pages = self.allocator.alloc(job.prompt_pages, contiguous=True)
            except CacheFull:
                return
            if self.layout.tail_bytes:
                if not self._free_tails:
                    self.allocator.free(pages)
                    return
                job.tail_slot = self._free_tails.pop()
            self._waiting.popleft()
            job.first_page = int(pages[0])
            job.state = JobState.QUEUED
            self._ready.append(job)
            self._ready_event.set()

    # ---- messages ----

    def _handle(self, m: wire.Message) -> None:
        if isinstance(m, wire.Fragment):
            self._on_fragment(m)
        elif isinstance(m, wire.Cancel):
            self._on_cancel((m.sender, m.request_id))
        elif isinstance(m, wire.Release):
            job = self._jobs.get((m.sender, m.request_id))
            if job is not None and job.state == JobState.HELD:
                self._unhold(job, wire.DONE, "")
            elif job is not None:  # only a READY's pages can be released
                self._bad(f"release of request {m.request_id}, which is {job.state.value}")
        elif not isinstance(m, wire.Heartbeat):
            self._bad(f"a prefiller does not take {type(m).__name__} messages")

    def _reject(self, key: Key, why: str) -> None:
        self._bad(why)
        self.stats["rejected"] += 1
        self._partial_drop(key)
        if key not in self._jobs:
            self._remember(key, wire.REJECTED, 0, why)
        self._confirm(key, wire.REJECTED, 0, why)

    def _partial_drop(self, key: Key) -> None:
        a = self._partial.pop(key, None)
        if a is not None:
            self._partial_bytes -= sum(len(c) for c in a.chunks.values())

    def _on_fragment(self, f: wire.Fragment) -> None:
        key = (f.sender, f.request_id)
        if key in self._jobs or key in self._recent:
            if key in self._recent and self._recent[key][0] in (wire.CANCELLED, wire.REJECTED):
                return  # cancelled (or refused) before all of it came: the rest is dropped
            self._reject(key, f"request {f.request_id}: duplicate request id")
            return
        problem, blob = self._assemble(key, f)
        if blob is None:
            if problem:
                self._reject(key, f"request {f.request_id}: {problem}")
            return  # else: more fragments to come
        try:
            req = wire.parse_request(f.request_id, blob)
            checked = wire.check_request(
                req, self.layout, max_write=self.eng.max_write_size, max_tokens=self.max_tokens
            )
            if req.pull and not self.pull:
                raise ProtocolError(f"request {f.request_id}: this prefiller does not serve pull requests")
            if len(self._waiting) >= self.max_waiting:
                raise ProtocolError(f"request {f.request_id}: {self.max_waiting} requests already waiting")
        except ProtocolError as e:
            self._reject(key, str(e))
            return
        job = PrefillJob(self, key, req, checked)
        self._jobs[key] = job
        self._waiting.append(job)
        self.stats["accepted"] += 1
        self._admit()

    def _assemble(self, key: Key, f: wire.Fragment) -> tuple[str, bytes | None]:
        """Add a fragment; returns (problem, None), ("", None) while incomplete, or ("", blob)."""
        a = self._partial.get(key)
        if a is None:
            if sum(1 for k in self._partial if k[0] == f.sender) >= 256:
                return "too many partial requests from one decoder", None
            a = self._partial[key] = _Assembly(f, {}, time.monotonic())
        first = a.frag
        problem = (
            "fragments disagree on the request's size or checksum"
            if (f.blob_len, f.frag_size, f.blob_crc) != (first.blob_len, first.frag_size, first.blob_crc)
            else f"fragment {f.index} twice"
            if f.index in a.chunks
            else "too much request data pending"
            if self._partial_bytes + len(f.chunk) > _MAX_PARTIAL_BYTES
            else ""
        )
        if problem:
            return problem, None
        a.chunks[f.index] = f.chunk
        self._partial_bytes += len(f.chunk)
        if len(a.chunks) < f.count:
            return "", None
        self._partial_drop(key)
        blob = b"".join(a.chunks[i] for i in range(f.count))
        if zlib.crc32(blob) != f.blob_crc:
            return "checksum mismatch", None
        return "", blob

    def _on_cancel(self, key: Key) -> None:
        job = self._jobs.get(key)
        if job is None:
            if key in self._partial:
                self._partial_drop(key)
            elif key in self._recent:
                status, arrivals, reason = self._recent[key]
                self._confirm(key, status, arrivals, reason)
                return
            # unknown: the cancel overtook the request (messages are unordered); remember it
            # so the request is dropped when it comes
            self._remember(key, wire.CANCELLED, 0, "cancelled")
            self._confirm(key, wire.CANCELLED, 0, "cancelled")
            return
        job.cancel_requested = True
        if job.state in (JobState.WAITING, JobState.QUEUED):
            self._drop_unstarted(job, wire.CANCELLED, "cancelled")
        elif job.state == JobState.HELD:
            self._unhold(job, wire.CANCELLED, "cancelled")
        else:
            job._stop("cancelled by the decoder")
            self._maybe_finish(job)

    def _tick(self) -> None:
        """Heartbeats to decoders we hold work for; stop the work of silent (dead) ones."""
        now = time.monotonic()
        for key, a in list(self._partial.items()):
            if now - a.started > 2 * self.peer_timeout:
                self._reject(key, f"request {key[1]}: incomplete after {2 * self.peer_timeout:g} s")
        decoders = {k[0] for k in self._jobs} | {k[0] for k in self._partial}
        live = []
        for d in decoders:
            if self.peers.silent_for(d, 0.0) <= self.peer_timeout:
                live.append(d)
                continue
            self.log.warning(
                "decoder %s silent for %.1f s: dropping its requests", d.hex()[:16], self.peer_timeout
            )
            self.stats["dead_decoders"] += 1
            for key in [k for k in self._partial if k[0] == d]:
                self._partial_drop(key)
            for job in [j for j in self._jobs.values() if j.decoder == d]:
                job.decoder_dead = True
                if job.state in (JobState.WAITING, JobState.QUEUED):
                    self._drop_unstarted(job, wire.FAILED, "decoder dead")
                elif job.state == JobState.HELD:
                    self._unhold(job, wire.FAILED, "decoder dead")
                else:
                    job._stop("decoder dead")
                    self._maybe_finish(job)
            self.peers.forget(d)
        self.peers.beat(live)
