"""What NIXL's and Mooncake's blocking APIs share: a private event-loop thread, an endpoint per
agent, raw-address translation, notifications and a metadata listener.

Those APIs are blocking and called from many threads (vLLM calls from a pool of 10, SGLang
from several), while an :class:`afabric.Engine` belongs to one event loop's thread. So each
process runs one private loop thread (:func:`runtime`, started by the first endpoint, never
at import); every engine of the layers lives on it, and callers hand it work through
:class:`Runtime` and wait on the result with the GIL released.

The API the layers build on:

- :func:`choose_provider` maps a framework's protocol name to an afabric provider
  (``AFABRIC_COMPAT_PROVIDER`` overrides it).
- :class:`Endpoint` — one agent's engine, its registered segments, its peers' region tables,
  its notification queue and its metadata listener. Its methods block and may be called from
  any thread:
  ``register``/``deregister`` raw memory (:class:`Segment`), ``info()`` (this agent as a
  :class:`PeerInfo`, what peers need), ``add_peer``/``remove_peer``/``peer`` (another agent's
  :class:`PeerInfo` under a key, with an optional refresh callable used once on an address
  miss), ``start`` (a batch of writes or reads between raw addresses, optionally followed by a
  notification; returns a :class:`Transfer`), ``notify``/``take_notifications``, ``serve`` (a
  handler for a listener request) and ``close``.
- :class:`Transfer` — ``poll()`` (``"pending"``, ``"done"``, ``"failed"``), ``wait()``,
  ``error``: a batch in flight, polled from any thread without starving the loop thread.
- :func:`request` — one request to another endpoint's metadata listener (``{"op":
  "metadata"}`` returns its :class:`PeerInfo` as JSON, ``{"op": "probe"}`` answers ``{"ok":
  true}``; layers add their own ops with :meth:`Endpoint.serve`).
- Errors a layer turns into its framework's return codes: :class:`CompatError` and its
  subclasses; afabric's own errors (``afabric.errors``) pass through from the engine.
"""

from __future__ import annotations

import asyncio
import atexit
import bisect
import concurrent.futures
import contextlib
import json
import logging
import os
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Literal, TypeVar

import numpy as np
import numpy.typing as npt

from .. import errors
from ..address import Address
from ..descriptor import MrDesc
from ..engine import Engine
from ..groups import GatherSource
from ..memory import MemoryRegion
from ..messages import TAG_COMPAT

T = TypeVar("T")
log = logging.getLogger("afabric.compat")

PROTOCOL_PROVIDERS: Mapping[str, str] = {"tcp": "tcp", "rdma": "auto", "efa": "efa", "nvlink": "nvlink"}
"""The afabric provider each framework protocol name maps to (``"rdma"``: the best network
provider this machine has, ``Engine("auto")``)."""

POLL_GRACE_S = 50e-6
"""How long :meth:`Transfer.poll` waits for a completion before it answers ``"pending"``. A
caller polling in a tight loop then spends most of its time with the GIL released, so the
loop thread that completes its transfer runs at once instead of at the interpreter's next
forced switch (5 ms)."""

DEADLINE_SLACK_S = 2.0
"""Added to a transfer's deadline beyond ``op_timeout`` and its bytes at 100 MB/s: the
engine fails a stalled operation itself after ``op_timeout``; the deadline is the backstop
that keeps a caller from ever waiting longer."""

MAX_FRAME = 64 << 20
"""The largest listener request or reply (bytes of JSON)."""

_IDLE_S = 30.0  # a listener connection silent this long is closed
_CLOSE_S = 2.0  # how long closing an endpoint waits for its transfers in flight


# ---- errors ----


class CompatError(errors.AfabricError):
    """A compatibility layer's own failure (the layer turns it into its API's return code)."""


class UnknownAddress(CompatError, LookupError):
    """An address range inside no registered segment (local), or none the peer published."""


class AddressOverlap(CompatError, ValueError):
    """Memory overlapping a segment registered already."""


class UnknownPeer(CompatError, LookupError):
    """No peer under that key."""


class MetadataError(CompatError):
    """Metadata that is malformed, or that could not be fetched."""


class TransferTimeout(CompatError, TimeoutError):
    """A transfer found no completion by its deadline."""


# ---- provider choice ----


def choose_provider(protocol: str | None = None, *, force_tcp: bool = False) -> str:
    """The afabric provider for a framework's protocol name.

    ``$AFABRIC_COMPAT_PROVIDER`` wins (e.g. ``cma`` where every peer is on this host); then
    ``force_tcp``; then :data:`PROTOCOL_PROVIDERS`; None means ``"auto"``.

    Raises:
        InvalidArgument: a protocol name not in :data:`PROTOCOL_PROVIDERS`.
    """
    override = os.environ.get("AFABRIC_COMPAT_PROVIDER", "").strip()
    if override:
        return override
    if force_tcp:
        return "tcp"
    if protocol is None:
        return "auto"
    try:
        return PROTOCOL_PROVIDERS[protocol.strip().lower()]
    except KeyError:
        known = ", ".join(PROTOCOL_PROVIDERS)
        raise errors.InvalidArgument(f"protocol {protocol!r} is not one of {known}") from None


async def _open_engine(
    provider: str, *, name: str, op_timeout: float, bind: str | None, nics: Sequence[str] | None
) -> Engine:
    """The one place the layers' engine is made."""
    return Engine(provider, name=name, op_timeout=op_timeout, bind=bind, nics=list(nics) if nics else None)


# ---- the loop thread ----


class Runtime:
    """The process's private event loop, run by one daemon thread."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._open: set[_State] = set()  # endpoints to close at exit
        self.thread = threading.Thread(target=self._main, name="afabric-compat", daemon=True)
        self.thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Run ``coro`` on the loop; returns at once."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (raises what it raised).

        Raises:
            UsageError: called on the loop's own thread (it would wait for itself).
            TimeoutError: no result within ``timeout`` (the coroutine is cancelled).
        """
        if threading.get_ident() == self.thread.ident:
            coro.close()
            raise errors.UsageError("a blocking afabric.compat call made on its own loop thread")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``fn`` on the loop's thread and wait for its result."""

        async def go() -> T:
            return fn(*args, **kwargs)

        return self.run(go())

    def _shutdown(self) -> None:
        """At exit: close what is still open (bounded), then stop the loop."""
        if self.pid != os.getpid() or not self.thread.is_alive():
            return
        states = list(self._open)
        if states:
            fut = self.submit(_close_all(states))
            with contextlib.suppress(Exception):
                fut.result(_CLOSE_S + 3.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(2.0)


async def _close_all(states: list[_State]) -> None:
    await asyncio.gather(*(s.aclose() for s in states), return_exceptions=True)


_RUNTIME: Runtime | None = None
_RUNTIME_LOCK = threading.Lock()
_FORK_HOOK = False


def _forget_runtime() -> None:
    """In a forked child: the parent's loop thread does not exist here; the next endpoint
    starts a new one."""
    global _RUNTIME, _RUNTIME_LOCK
    _RUNTIME = None
    _RUNTIME_LOCK = threading.Lock()


def runtime() -> Runtime:
    """This process's loop thread, started on first use (and again in a forked child)."""
    global _RUNTIME, _FORK_HOOK
    rt = _RUNTIME
    if rt is not None and rt.pid == os.getpid():
        return rt
    with _RUNTIME_LOCK:
        if _RUNTIME is None or _RUNTIME.pid != os.getpid():
            if not _FORK_HOOK:
                os.register_at_fork(after_in_child=_forget_runtime)
                _FORK_HOOK = True
            _RUNTIME = Runtime()
            atexit.register(_RUNTIME._shutdown)
        return _RUNTIME


# ---- segments, region tables, peers ----


@dataclass(frozen=True)
class Segment:
    """Registered memory: ``length`` bytes at virtual address ``base`` (of the process that
    registered it), and the descriptor (``afabric.MrDesc`` bytes) that reaches it."""

    base: int
    length: int
    desc: bytes
    device: int = -1

    def to_json(self) -> dict[str, Any]:
        return {"base": self.base, "length": self.length, "device": self.device, "desc": self.desc.hex()}

    @classmethod
    def from_json(cls, d: Any) -> Segment:
        """Raises MetadataError on anything malformed."""
        try:
            base, length, device, desc = d["base"], d["length"], d.get("device", -1), bytes.fromhex(d["desc"])
        except (TypeError, KeyError, ValueError, AttributeError) as e:
            raise MetadataError(f"malformed segment {d!r:.200}: {e}") from None
        ints = all(type(v) is int for v in (base, length, device))
        if not ints or not (0 <= base < 1 << 64 and 0 <= length < 1 << 64):
            raise MetadataError(f"malformed segment {d!r:.200}")
        return cls(base, length, desc, device)


class RegionTable:
    """Segments sorted by base address: which one holds a raw address range, and where.
    Immutable: a change builds a new table, so readers on other threads need no lock."""

    def __init__(self, segments: Iterable[Segment] = ()) -> None:
        self.segments: tuple[Segment, ...] = tuple(sorted(segments, key=lambda s: s.base))
        self._bases = [s.base for s in self.segments]
        self._np_bases = np.array(self._bases, dtype=np.int64) if self._bases else np.zeros(0, np.int64)
        self._np_ends = np.array([s.base + s.length for s in self.segments], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.segments)

    def find(self, addr: int, length: int) -> tuple[Segment, int] | None:
        """The segment holding ``[addr, addr + length)`` and the offset of ``addr`` in it."""
        i = bisect.bisect_right(self._bases, addr) - 1
        if i < 0:
            return None
        seg = self.segments[i]
        off = addr - seg.base
        return (seg, off) if off + length <= seg.length else None

    def find_many(
        self, addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """Vectorised :meth:`find`: segment indices, offsets, and which ranges were found."""
        idx = np.searchsorted(self._np_bases, addrs, side="right") - 1
        safe = np.maximum(idx, 0)
        if not len(self.segments):
            return safe, np.zeros_like(addrs), np.zeros(len(addrs), dtype=np.bool_)
        ok = (idx >= 0) & (addrs + lengths <= self._np_ends[safe])
        return safe, addrs - self._np_bases[safe], ok

    def overlaps(self, base: int, length: int) -> bool:
        i = bisect.bisect_right(self._bases, base + max(length, 1) - 1) - 1
        return i >= 0 and self.segments[i].base + self.segments[i].length > base

    def with_segment(self, seg: Segment) -> RegionTable:
        return RegionTable((*self.segments, seg))

    def without(self, base: int) -> RegionTable:
        return RegionTable(s for s in self.segments if s.base != base)


@dataclass(frozen=True)
class PeerInfo:
    """What one agent publishes so that others can reach it: its name, its engine's address,
    its segments, its listener, and whatever the layer adds (``extra``, JSON values)."""

    name: str
    address: bytes
    segments: tuple[Segment, ...] = ()
    listener: tuple[str, int] | None = None
    provider: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "afabric_compat": 1,
            "name": self.name,
            "address": self.address.hex(),
            "provider": self.provider,
            "listener": list(self.listener) if self.listener else None,
            "segments": [s.to_json() for s in self.segments],
            "extra": dict(self.extra),
        }

    def to_bytes(self) -> bytes:
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, d: Any) -> PeerInfo:
        """Raises MetadataError on anything malformed (the address itself is checked too)."""
        if not isinstance(d, dict) or d.get("afabric_compat") != 1:
            raise MetadataError("not afabric.compat metadata")
        try:
            name, address = d["name"], bytes.fromhex(d["address"])
            listener = d.get("listener")
            lst = (str(listener[0]), int(listener[1])) if listener else None
            segs = tuple(Segment.from_json(s) for s in d.get("segments", ()))
            extra = d.get("extra") or {}
            provider = str(d.get("provider", ""))
        except (TypeError, KeyError, ValueError, IndexError) as e:
            raise MetadataError(f"malformed metadata: {e}") from None
        if not isinstance(name, str) or not isinstance(extra, dict):
            raise MetadataError("malformed metadata: name or extra")
        try:
            Address.from_bytes(address)
        except errors.AfabricError as e:
            raise MetadataError(f"malformed metadata: engine address: {e}") from None
        return cls(name, address, segs, lst, provider, extra)

    @classmethod
    def from_bytes(cls, blob: bytes) -> PeerInfo:
        try:
            d = json.loads(blob)
        except (ValueError, UnicodeDecodeError) as e:
            raise MetadataError(f"metadata is not JSON: {e}") from None
        return cls.from_json(d)


class _Peer:
    """A peer's region table and imported descriptors; refreshed through ``refresh``."""

    def __init__(self, info: PeerInfo, refresh: Callable[[], PeerInfo | None] | None) -> None:
        self.refresh = refresh
        self.lock = threading.Lock()  # one refresh at a time
        self.update(info)

    def update(self, info: PeerInfo) -> None:
        descs = [MrDesc.from_bytes(s.desc) for s in sorted(info.segments, key=lambda s: s.base)]
        address = Address.from_bytes(info.address)
        # one assignment: readers on other threads see the old state or the new one
        self.state = (info, address, RegionTable(info.segments), descs)


@dataclass(frozen=True)
class Notification:
    """A notification received: the sending engine's address and the payload."""

    sender: bytes
    payload: bytes


# ---- transfers ----


class Transfer:
    """A batch in flight: poll or wait on it from any thread."""

    def __init__(self, fut: concurrent.futures.Future[None], deadline: float | None) -> None:
        self._fut = fut
        self._done = threading.Event()
        self._expired: TransferTimeout | None = None
        self.deadline = deadline
        fut.add_done_callback(lambda _: self._done.set())

    def poll(self) -> Literal["pending", "done", "failed"]:
        """The state now; while pending, first waits up to :data:`POLL_GRACE_S` for it."""
        if not self._done.is_set() and not self._done.wait(POLL_GRACE_S):
            if self._expired is None and (self.deadline is None or time.monotonic() < self.deadline):
                return "pending"
            self._expire()
            return "failed"
        return "done" if self.error is None else "failed"

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until done, the deadline or ``timeout``; True if it succeeded."""
        limit = self.deadline
        if timeout is not None:
            mine = time.monotonic() + timeout
            limit = min(limit, mine) if limit is not None else mine
        if not self._done.wait(None if limit is None else max(0.0, limit - time.monotonic())):
            if timeout is not None and (self.deadline is None or time.monotonic() < self.deadline):
                return False
            self._expire()
            return False
        return self.error is None

    def done(self) -> bool:
        return self._done.is_set() or self._expired is not None

    @property
    def error(self) -> BaseException | None:
        """Why it failed; None while pending or once it succeeded."""
        if self._expired is not None:
            return self._expired
        if not self._fut.done():
            return None
        if self._fut.cancelled():
            return errors.Cancelled("transfer cancelled")
        return self._fut.exception()

    def cancel(self) -> None:
        """Stop waiting for it: operations already posted still complete (the engine keeps
        their buffers), but nothing that follows them (the notification) is sent."""
        if not self._done.is_set():
            self._fut.cancel()

    def _expire(self) -> None:
        if self._expired is None and not self._done.is_set():
            self._expired = TransferTimeout("no completion by the transfer's deadline")
            self._fut.cancel()  # the engine keeps the buffers referenced until its completion


def _deadline(op_timeout: float, nbytes: int) -> float | None:
    if not op_timeout:
        return None
    return time.monotonic() + op_timeout + nbytes / 1e8 + DEADLINE_SLACK_S


# ---- the endpoint ----

Handler = Callable[[dict[str, Any]], dict[str, Any]]
_Ints = npt.NDArray[np.int64]
# one local region's share of a batch: region, descriptor(s), lengths, local and remote offsets
_Group = tuple[MemoryRegion, "MrDesc | list[MrDesc]", _Ints, _Ints, _Ints]


class _State:
    """What the loop's tasks and the listener hold of an endpoint: never the Endpoint
    itself, so that an agent nobody references is collected (and closed)."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        self.engine: Engine | None = None
        self.server: asyncio.base_events.Server | None = None
        self.recv_task: asyncio.Task[None] | None = None
        self.notes: deque[Notification] = deque()
        self.noted = threading.Event()  # set when a notification is queued
        self.handlers: dict[str, Callable[[], Handler | None]] = {}
        self.info: PeerInfo | None = None
        self.closed = False
        self.operations = 0  # afabric operations posted by run(): the layers' tests count them

    async def open(
        self,
        provider: str,
        name: str,
        op_timeout: float,
        bind: str | None,
        nics: Sequence[str] | None,
        listen: tuple[str, int] | None,
    ) -> None:
        self.engine = await _open_engine(provider, name=name, op_timeout=op_timeout, bind=bind, nics=nics)
        try:
            if listen is not None:
                self.server = await asyncio.start_server(self._serve, listen[0], listen[1])
            self.recv_task = asyncio.ensure_future(self._receive(self.engine))
        except BaseException:
            self.engine.close()
            raise
        self.rt._open.add(self)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.rt._open.discard(self)
        if self.server is not None:
            self.server.close()  # the port is free from here on
        if self.recv_task is not None:
            self.recv_task.cancel()
        if self.engine is not None:
            try:
                await self.engine.aclose(timeout=_CLOSE_S)
            except Exception:  # closing must finish
                log.exception("closing engine %s", self.engine.name)
                self.engine.close()

    async def _receive(self, eng: Engine) -> None:
        while True:
            try:
                msg = await eng.recv(tag=TAG_COMPAT)
            except errors.EngineClosed:
                return
            self.notes.append(Notification(bytes(msg.sender), bytes(msg.data)))
            self.noted.set()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    head = await asyncio.wait_for(reader.readexactly(4), _IDLE_S)
                    size = int.from_bytes(head, "big")
                    if size > MAX_FRAME:
                        return
                    body = await asyncio.wait_for(reader.readexactly(size), _IDLE_S)
                except (asyncio.IncompleteReadError, TimeoutError, OSError):
                    return
                writer.write(_frame(self._answer(body)))
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            return
        finally:
            writer.close()

    def _answer(self, body: bytes) -> dict[str, Any]:
        try:
            req = json.loads(body)
            op = req["op"]
        except (ValueError, TypeError, KeyError, UnicodeDecodeError):
            return {"error": "malformed request"}
        if op == "probe":
            return {"ok": True}
        if op == "metadata":
            return self.info.to_json() if self.info is not None else {"error": "not ready"}
        get = self.handlers.get(op) if isinstance(op, str) else None
        handler = get() if get is not None else None
        if handler is None:
            return {"error": f"unknown op {op!r:.50}"}
        try:
            return handler(req)
        except Exception as e:  # noqa: BLE001 - a handler's failure is the requester's answer
            return {"error": f"{type(e).__name__}: {e}"}

    async def run(self, kind: str, groups: list[_Group], address: Address, payload: bytes | None) -> None:
        eng = self.engine
        if eng is None or self.closed:
            raise errors.EngineClosed("the agent is closed")
        aws: list[Coroutine[Any, Any, None]] = []
        for mr, desc, lengths, local, remote in groups:
            if kind == "write":
                if len(lengths) == 1 and isinstance(desc, MrDesc):
                    aws.append(eng.write(mr, desc, int(lengths[0]), int(local[0]), int(remote[0])))
                else:
                    aws.append(eng.write_many(mr, desc, lengths, local, remote))
            elif len(lengths) == 1 and isinstance(desc, MrDesc):
                aws.append(eng.read(mr, desc, int(lengths[0]), int(remote[0]), int(local[0])))
            else:
                descs = desc if isinstance(desc, list) else [desc] * len(lengths)
                sources = [
                    GatherSource(d, int(n), int(r), int(lo))
                    for d, n, r, lo in zip(
                        descs, lengths.tolist(), remote.tolist(), local.tolist(), strict=True
                    )
                ]
                aws.append(eng.gather(mr, sources))
        self.operations += len(aws)
        if len(aws) == 1:
            await aws[0]
        elif aws:
            results = await asyncio.gather(*aws, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        if payload is not None:
            await eng.send(address, payload, tag=TAG_COMPAT)


def _frame(obj: Any) -> bytes:
    body = json.dumps(obj, separators=(",", ":")).encode()
    return len(body).to_bytes(4, "big") + body


def request(host: str, port: int, message: Mapping[str, Any], timeout: float = 5.0) -> dict[str, Any]:
    """One request to an endpoint's metadata listener; blocks up to ``timeout`` per step.

    Raises:
        MetadataError: unreachable, closed early, malformed, or answered ``{"error": ...}``.
    """
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(_frame(dict(message)))
            head = _recv_exact(s, 4)
            size = int.from_bytes(head, "big")
            if size > MAX_FRAME:
                raise MetadataError(f"{host}:{port}: reply of {size} bytes")
            reply = json.loads(_recv_exact(s, size))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise MetadataError(f"{host}:{port}: {type(e).__name__}: {e}") from None
    if not isinstance(reply, dict):
        raise MetadataError(f"{host}:{port}: malformed reply")
    if "error" in reply:
        raise MetadataError(f"{host}:{port}: {reply['error']}")
    return reply


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed early")
        buf += chunk
    return bytes(buf)


def _close_collected(state: _State) -> None:
    """An endpoint was collected: close its engine and listener on the loop (never waits:
    collection may happen on the loop's own thread)."""
    rt = state.rt
    if rt.pid != os.getpid() or rt.loop.is_closed():
        return
    with contextlib.suppress(RuntimeError):
        rt.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(state.aclose()))


def _column(values: Sequence[int] | npt.NDArray[Any], what: str) -> npt.NDArray[np.int64]:
    try:
        arr = np.asarray(values, dtype=np.int64)
    except (OverflowError, ValueError, TypeError) as e:
        raise errors.InvalidArgument(f"{what}: {e}") from None
    if arr.ndim != 1:
        raise errors.InvalidArgument(f"{what} must be a flat sequence of integers")
    if len(arr) and arr.min() < 0:
        raise errors.InvalidArgument(f"{what} holds a negative value")
    return arr


class Endpoint:
    """One agent's engine, segments, peers, notifications and metadata listener.

    Every method blocks and may be called from any thread of the process that made it.
    Closed by :meth:`close` or when collected (its engine and listener port are released).

    Args:
        name: the agent's name (in logs and in :meth:`info`).
        provider: the afabric provider (see :func:`choose_provider`).
        op_timeout: seconds without progress before an operation fails.
        bind: the interface address the engine binds (tcp: loopback unless given).
        nics: NIC names for the engine, or None.
        listen: ``(host, port)`` for the metadata listener (port 0: any), or None for none.

    Raises:
        afabric.errors.AfabricError: the engine could not be made (e.g. ProviderUnavailable).
        OSError: the listener could not bind.
    """

    def __init__(
        self,
        name: str,
        provider: str,
        *,
        op_timeout: float = 20.0,
        bind: str | None = None,
        nics: Sequence[str] | None = None,
        listen: tuple[str, int] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> None:
        self._pid = os.getpid()
        self._rt = runtime()
        self._state = _State(self._rt)
        self.name = name
        self.op_timeout = op_timeout
        self._lock = threading.Lock()  # registrations (readers use the immutable tables)
        self._local = RegionTable()
        self._mrs: dict[int, MemoryRegion] = {}
        self._peers: dict[str, _Peer] = {}
        self._extra = dict(extra or {})
        self._rt.run(self._state.open(provider, name, op_timeout, bind, nics, listen))
        eng = self._state.engine
        assert eng is not None
        self.provider: str = eng.provider
        self.transports: tuple[str, ...] = eng.transports
        self.address: bytes = bytes(eng.address)
        self.max_write_size: int = eng.max_write_size
        self.listener: tuple[str, int] | None = None
        if self._state.server is not None:
            sockname = self._state.server.sockets[0].getsockname()
            self.listener = (listen[0] if listen and listen[0] else sockname[0], int(sockname[1]))
        self._publish()
        self._finalizer = weakref.finalize(self, _close_collected, self._state)
        self._finalizer.atexit = False  # the runtime's exit hook closes it, waiting

    # ---- lifetime ----

    @property
    def closed(self) -> bool:
        return self._state.closed

    @property
    def operations(self) -> int:
        """afabric operations (writes, write_many, reads, gathers) posted for transfers so far."""
        return self._state.operations

    def close(self) -> None:
        """Close the engine (bounded wait for transfers in flight) and the listener. On the
        loop's own thread (a listener handler) it only starts closing."""
        if os.getpid() != self._pid or not self._finalizer.detach():
            return
        if threading.get_ident() == self._rt.thread.ident:
            _close_collected(self._state)
            return
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self._rt.run(self._state.aclose(), _CLOSE_S + 5.0)

    def _check(self) -> Engine:
        if os.getpid() != self._pid:
            raise errors.UsageError(
                f"agent {self.name} was made in process {self._pid}; this process inherited it "
                "through fork and cannot use it (make a new agent here)"
            )
        eng = self._state.engine
        if eng is None or self._state.closed or eng.closed:
            raise errors.EngineClosed(f"agent {self.name} is closed")
        return eng

    # ---- memory ----

    def register(self, base: int, length: int, device: int = -1) -> Segment:
        """Register ``length`` bytes at ``base`` for peers to write and read.

        Raises:
            InvalidArgument: base or length is not a non-negative int (length 0 included).
            AddressOverlap: it overlaps a segment registered already.
            RegistrationError: the provider cannot register it.
        """
        eng = self._check()
        ints = type(base) is int and type(length) is int
        if not ints or not (base > 0 and length > 0 and base + length < 1 << 63):
            raise errors.InvalidArgument(f"register: bad range base={base!r} length={length!r}")
        with self._lock:
            if self._local.overlaps(base, length):
                raise AddressOverlap(f"{length} bytes at {base:#x} overlap a registered segment")
            mr = self._rt.call(eng.register_ptr, base, length, device, remote="rw")
            assert mr.descriptor is not None
            seg = Segment(base, length, bytes(mr.descriptor), device)
            self._mrs[base] = mr
            self._local = self._local.with_segment(seg)
            self._publish()
        return seg

    def deregister(self, base: int) -> Segment:
        """Deregister the segment registered at ``base`` (its base, not an inner address).

        Raises:
            UnknownAddress: no segment starts there.
        """
        eng = self._check()
        with self._lock:
            mr = self._mrs.get(base)
            seg = next((s for s in self._local.segments if s.base == base), None)
            if mr is None or seg is None:
                raise UnknownAddress(f"no segment registered at {base!r}")
            self._rt.call(eng.deregister, mr)
            del self._mrs[base]
            self._local = self._local.without(base)
            self._publish()
        return seg

    def segments(self) -> tuple[Segment, ...]:
        """This agent's segments, by base address."""
        return self._local.segments

    def find_local(self, addr: int, length: int) -> tuple[Segment, int] | None:
        """The local segment holding ``[addr, addr + length)`` and the offset in it."""
        return self._local.find(addr, length)

    def info(self) -> PeerInfo:
        """This agent as peers need it (what its listener answers to ``{"op": "metadata"}``)."""
        info = self._state.info
        assert info is not None
        return info

    def set_extra(self, extra: Mapping[str, Any]) -> None:
        """Replace the layer's own fields of :meth:`info` (JSON values)."""
        with self._lock:
            self._extra = dict(extra)
            self._publish()

    def _publish(self) -> None:
        self._state.info = PeerInfo(
            self.name, self.address, self._local.segments, self.listener, self.provider, dict(self._extra)
        )

    # ---- peers ----

    def add_peer(
        self, key: str, info: PeerInfo, refresh: Callable[[], PeerInfo | None] | None = None
    ) -> None:
        """Know a peer under ``key`` (replacing what was known under it).

        ``refresh`` is called (on the caller's thread) at most once per transfer that names an
        address outside the peer's known segments; it returns the peer's current info or None.

        Raises:
            BadDescriptor: the info's address or a segment's descriptor is malformed.
        """
        peer = _Peer(info, refresh)
        with self._lock:
            self._peers[key] = peer

    def update_peer(self, key: str, info: PeerInfo) -> None:
        """Replace a known peer's info, keeping its refresh callable.

        Raises:
            UnknownPeer: no peer under ``key``.
        """
        peer = self._peers.get(key)
        if peer is None:
            raise UnknownPeer(f"no peer {key!r}")
        peer.update(info)

    def remove_peer(self, key: str) -> bool:
        """Forget a peer; False if none was known under ``key``."""
        with self._lock:
            return self._peers.pop(key, None) is not None

    def peer(self, key: str) -> PeerInfo | None:
        """What is known of the peer under ``key``, or None."""
        p = self._peers.get(key)
        return p.state[0] if p is not None else None

    def peers(self) -> list[str]:
        return list(self._peers)

    # ---- transfers ----

    def start(
        self,
        kind: Literal["write", "read"],
        key: str,
        local: Sequence[int] | npt.NDArray[Any],
        remote: Sequence[int] | npt.NDArray[Any],
        lengths: Sequence[int] | npt.NDArray[Any],
        notify: bytes | None = None,
    ) -> Transfer:
        """Start a batch: entry i moves ``lengths[i]`` bytes between local address ``local[i]``
        and the peer's address ``remote[i]`` (``"write"``: local to remote; ``"read"``: remote
        to local). With ``notify``, once every entry completed (so the data is at the target),
        the payload goes to the peer's notification queue.

        Raises (before anything is posted):
            UnknownPeer: no peer under ``key``.
            InvalidArgument: columns of different lengths, negative values, a bad kind.
            UnknownAddress: a local range outside this agent's segments, or a remote range
                outside the peer's (after one refresh).
            EngineClosed / UsageError: the agent is closed, or inherited through fork.
        """
        self._check()
        if kind not in ("write", "read"):
            raise errors.InvalidArgument(f"kind must be 'write' or 'read', got {kind!r}")
        peer = self._peers.get(key)
        if peer is None:
            raise UnknownPeer(f"no peer {key!r}")
        loc, rem = _column(local, "local addresses"), _column(remote, "remote addresses")
        lens = _column(lengths, "lengths")
        if not len(loc) == len(rem) == len(lens):
            raise errors.InvalidArgument(
                f"{len(loc)} local addresses, {len(rem)} remote addresses and {len(lens)} lengths"
            )
        keep = lens > 0
        if not keep.all():
            loc, rem, lens = loc[keep], rem[keep], lens[keep]
        if len(lens) and int(lens.max()) > self.max_write_size:
            loc, rem, lens = _split(loc, rem, lens, self.max_write_size)
        table = self._local
        li, loff, lok = table.find_many(loc, lens)
        if not lok.all():
            bad = int(np.argmin(lok))
            raise UnknownAddress(
                f"local range of {int(lens[bad])} bytes at {int(loc[bad]):#x} is inside no registered segment"
            )
        info, address, rtable, descs = peer.state
        ri, roff, rok = rtable.find_many(rem, lens)
        if not rok.all() and peer.refresh is not None:
            with peer.lock:
                if peer.state[0] is info:  # nobody refreshed meanwhile
                    fresh = peer.refresh()
                    if fresh is not None:
                        peer.update(fresh)
            info, address, rtable, descs = peer.state
            ri, roff, rok = rtable.find_many(rem, lens)
        if not rok.all():
            bad = int(np.argmin(rok))
            raise UnknownAddress(
                f"remote range of {int(lens[bad])} bytes at {int(rem[bad]):#x} is inside no segment "
                f"{info.name} published"
            )
        groups: list[_Group] = []
        mrs = [self._mrs.get(s.base) for s in table.segments]
        for g in np.unique(li):
            rows = np.flatnonzero(li == g) if len(table) > 1 else np.arange(len(li))
            mr = mrs[int(g)]
            if mr is None:  # deregistered meanwhile
                raise UnknownAddress(f"local segment at {table.segments[int(g)].base:#x} was deregistered")
            seg_ids = ri[rows]
            first = int(seg_ids[0])
            desc: MrDesc | list[MrDesc] = (
                descs[first] if (seg_ids == first).all() else [descs[int(i)] for i in seg_ids.tolist()]
            )
            groups.append((mr, desc, lens[rows], loff[rows], roff[rows]))
        fut = self._rt.submit(self._state.run(kind, groups, address, notify))
        return Transfer(fut, _deadline(self.op_timeout, int(lens.sum())))

    def notify(self, key: str, payload: bytes) -> Transfer:
        """Send ``payload`` to the peer's notification queue.

        Raises:
            UnknownPeer: no peer under ``key``.
        """
        self._check()
        peer = self._peers.get(key)
        if peer is None:
            raise UnknownPeer(f"no peer {key!r}")
        fut = self._rt.submit(self._state.run("write", [], peer.state[1], bytes(payload)))
        return Transfer(fut, _deadline(self.op_timeout, len(payload)))

    def take_notifications(self) -> list[Notification]:
        """Every notification received since the last call, oldest first. With none queued it
        first waits up to :data:`POLL_GRACE_S` for one (a caller polling in a tight loop
        leaves the GIL to the loop thread that receives them)."""
        notes = self._state.notes
        if not notes:
            self._state.noted.wait(POLL_GRACE_S)
        self._state.noted.clear()
        out = []
        while notes:
            try:
                out.append(notes.popleft())
            except IndexError:
                break
        return out

    # ---- listener ----

    def serve(self, op: str, handler: Handler) -> None:
        """Answer listener requests ``{"op": op, ...}`` with ``handler(request)`` (a JSON
        object), called on the loop's thread: it must not block. A bound method is held
        weakly (so the agent it belongs to can still be collected)."""
        if op in ("metadata", "probe"):
            raise errors.InvalidArgument(f"op {op!r} is built in")
        if isinstance(handler, MethodType):
            ref = weakref.WeakMethod(handler)
            self._state.handlers[op] = ref
        else:
            self._state.handlers[op] = lambda: handler


def _split(
    loc: npt.NDArray[np.int64], rem: npt.NDArray[np.int64], lens: npt.NDArray[np.int64], most: int
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """Entries longer than ``most`` bytes become several of at most ``most``."""
    out_l: list[int] = []
    out_r: list[int] = []
    out_n: list[int] = []
    for lo, r, n in zip(loc.tolist(), rem.tolist(), lens.tolist(), strict=True):
        for off in range(0, n, most):
            out_l.append(lo + off)
            out_r.append(r + off)
            out_n.append(min(most, n - off))
    return (np.array(out_l, np.int64), np.array(out_r, np.int64), np.array(out_n, np.int64))
