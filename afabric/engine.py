"""The asyncio facade: :class:`Engine` turns shim completions into awaited results.

Every operation is one ctypes call that enqueues a request for the shim's worker thread;
completions come back through the shim's ring, announced on an eventfd that the loop
watches with ``add_reader``; one drain call resolves a batch of futures on the loop's
thread. Python never runs on the worker; the worker never takes the GIL.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import logging
import os
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, NoReturn, cast

import numpy as np
import numpy.typing as npt

from . import _native, errors, registry, testing
from ._messaging import MessagingMixin
from ._ops import Op, op_label
from .address import Address
from .descriptor import MrDesc
from .groups import GatherSource, PeerGroup, ScatterTarget
from .lengths import LengthFrom
from .memory import BufferSpan, MemoryRegion, span_of
from .pages import Pages
from .peers import PEER_CLOSED, PeerEvent, PeerHub, heartbeat_ms, stop_ms
from .provider import ProviderSpec
from .stats import EngineStats, NicStats
from .timing import OpTiming
from .triggers import Trigger
from .watcher import UvmWatcher

IMM_MAX = 0xFFFFFFFF
# A worker inside one provider call this long is stuck: the engine fails everything in
# flight with errors.EngineStuck and closes itself (the shim's AFS_STUCK_MS).
WORKER_STUCK_S = _native.STUCK_MS / 1000
_NO_IMM = _native.NO_IMM
U64_MAX = (1 << 64) - 1
_REMOTE_CACHE_MAX = 65536
# The loop polls the completion ring (Engine._poll_tick) only with this few operations in
# flight: where it waits for one or a few, the fd's wake-up is the latency; with many, the
# loop has work anyway and one fd signal per batch of completions is cheaper.
_POLL_MAX_IN_FLIGHT = 4
# Each look keeps looking, in C with the GIL released, for up to this long (afs_pending_wait):
# a completion that lands meanwhile is found at once, not one loop iteration later (each costs
# an epoll_wait system call, several µs where system calls are slow); other tasks wait at
# most this long per look.
_POLL_SLICE_NS = 5_000
# An operation awaited alone gets its first look at the ring from the awaiting call itself
# (_look_inline): this many in a row at most, then one await that yields to the loop.
_INLINE_RUN = 8
# A write or read awaited alone is looked for in the call that submits it (afs_submit_take)
# for up to spin_us, at most this long: found there, its completion costs no future, no drain
# and no loop iteration (complete -> resume 1.8-2.3 µs against 5.7-8.9 through the poll tick,
# 16-core GPU machine; docs/guide/progress.md). tcp's 8 B writes complete 16-18 µs
# after posting (the target acknowledges each) and p99 ~50 µs after the call there: one look
# of a poll slice misses them. A longer look costs a found one nothing (it ends at the
# completion); one that misses held the loop this long, as the poll tick would have spun in
# slices meanwhile (it polls spin_us after a submission).
_TAKE_MAX_NS = 50_000


def _u64(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.InvalidArgument(f"{name} must be an integer, got {type(value).__name__}")
    v = int(value)
    if v < 0 or v > U64_MAX:
        raise errors.OutOfRange(f"{name} {v} is negative or too large")
    return v


def _int_env(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def _bounded(value: Any, name: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise errors.InvalidArgument(f"{name} must be an int in {lo}..{hi}, got {value!r}")
    return value


def _target_columns(
    targets: Sequence[ScatterTarget | GatherSource],
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Lengths, source and destination offsets of scatter targets as uint64 columns: one
    numpy conversion for plain in-range ints (the common case), else a checked loop that
    names the offending target."""
    rows = [(t.length, t.src_offset, t.dst_offset) for t in targets]
    if all(type(v) is int and 0 <= v <= U64_MAX for row in rows for v in row):
        cols = np.array(rows, dtype=np.uint64).reshape(len(rows), 3)
    else:
        cols = np.empty((len(rows), 3), dtype=np.uint64)
        for i, (length, src_off, dst_off) in enumerate(rows):
            cols[i] = (
                _u64(length, f"target {i} length"),
                _u64(src_off, f"target {i} src_offset"),
                _u64(dst_off, f"target {i} dst_offset"),
            )
    return (
        np.ascontiguousarray(cols[:, 0]),
        np.ascontiguousarray(cols[:, 1]),
        np.ascontiguousarray(cols[:, 2]),
    )


def _column_len(value: Any, name: str) -> int:
    """Entries in a write_many argument given per write (1-D array or sequence)."""
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return len(value)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, memoryview)):
        return len(value)
    raise errors.InvalidArgument(
        f"{name} must be an int, a sequence of ints or a 1-D integer array, got {type(value).__name__}"
        + (f" of {value.ndim} dimensions" if isinstance(value, np.ndarray) else "")
    )


def _u64_column(value: Any, name: str, n: int) -> npt.NDArray[np.uint64]:
    """One write_many argument as n uint64 values: an int for every write, or one entry
    per write (a 1-D integer array or a sequence of ints), each checked like _u64."""
    if isinstance(value, (int, np.integer)):
        return np.full(n, _u64(value, name), dtype=np.uint64)
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise errors.InvalidArgument(
                f"{name} must be a 1-D integer array, got {value.ndim}-D {value.dtype}"
            )
        if value.dtype.kind == "i" and n and (neg := np.flatnonzero(value < 0)).size:
            raise errors.OutOfRange(f"{name}[{int(neg[0])}] {int(value[neg[0]])} is negative")
        return np.ascontiguousarray(value, dtype=np.uint64)
    if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, Sequence):
        raise errors.InvalidArgument(
            f"{name} must be an int, a sequence of ints or an integer array, got {type(value).__name__}"
        )
    if all(type(v) is int and 0 <= v <= U64_MAX for v in value):
        return np.array(value, dtype=np.uint64).reshape(n)
    return np.array([_u64(v, f"{name}[{i}]") for i, v in enumerate(value)], dtype=np.uint64).reshape(n)


_ACCESS = {True: "w", False: "", "w": "w", "r": "r", "rw": "rw", "wr": "rw"}


def _access(remote: Any) -> str:
    """register's ``remote``: True/"w", "r", "rw" or False, as "w", "r", "rw" or ""."""
    if isinstance(remote, (bool, str)) and remote in _ACCESS:
        return _ACCESS[remote]
    raise errors.InvalidArgument(f'remote must be "w", "r", "rw", True (= "w") or False, got {remote!r}')


def _imm(value: Any) -> int:
    if value is None:
        return _native.NO_IMM
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise errors.ImmediateOutOfRange(
            f"immediate must be an int in 0..{IMM_MAX}, got {type(value).__name__}"
        )
    v = int(value)
    if v < 0 or v > IMM_MAX:
        raise errors.ImmediateOutOfRange(f"immediate {v} outside 0..{IMM_MAX}")
    return v


def _on_ready(ref: weakref.ref[Engine]) -> None:
    eng = ref()
    if eng is not None and eng._process():
        eng._woken += 1


def _on_poll(ref: weakref.ref[Engine]) -> None:
    eng = ref()
    if eng is not None:
        eng._poll_tick()


# ---- fork ----
# A child inherits every engine's Python object, but not its worker thread; it shares the
# engine's eventfd and the loop's epoll set with the parent. The child marks each inherited
# engine inert, so that nothing there calls into the native engine or touches that epoll set.
_LIVE: weakref.WeakSet[Engine] = weakref.WeakSet()
_get_ident = threading.get_ident
_monotonic = time.monotonic
_TAKEN = _native.TAKEN
_OP_WRITE = _native.OP_WRITE
_fork_hook = False
_exit_hook = False
# Buffers of engines whose worker could not be stopped (close raised): it may still write.
_ABANDONED: list[object] = []


def _after_fork_in_child() -> None:
    for eng in list(_LIVE):
        eng._forked = True
        eng._closed = True


def _tell_closed_in_process(closing: Engine) -> None:
    """Engines of this process that resolved `closing` hear that it closed (peer_events():
    "down", reason "closed"), on their own loops. Peers in other processes hear it from its
    goodbye (shim/keepalive.c), which never goes to an engine of the same process."""
    blob = bytes(closing.address)
    for other in list(_LIVE):
        if other is closing or other._closed or other._forked:
            continue
        if other._thread == _get_ident():
            other._peer_closed_here(blob)
        else:
            with contextlib.suppress(RuntimeError):  # its loop is closed: nobody listens
                other._loop.call_soon_threadsafe(other._peer_closed_here, blob)


def _close_at_exit() -> None:
    """At interpreter exit, the engines of this process still open (never closed, or their
    ``async with`` cut short) are closed as ``__del__`` would close them: warned about
    (ResourceWarning), then aborted. Their native resources go now, not with the process:
    shm's and cma's files in /dev/shm are removed (a process killed before this runs leaves
    them to the next engine on the host, which reclaims those of dead owners)."""
    pid = os.getpid()
    for eng in list(_LIVE):
        if eng._closed or eng._forked or eng._pid != pid:
            continue
        with contextlib.suppress(Exception):  # another thread's open loop: left to the OS
            warnings.warn(f"afabric.Engine {eng.name} still open at exit: closed", ResourceWarning,
                          source=eng, stacklevel=1)  # fmt: skip
            eng.close()


def _track(eng: Engine) -> None:
    global _fork_hook, _exit_hook
    if not _fork_hook and hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_after_fork_in_child)
        _fork_hook = True
    if not _exit_hook:
        atexit.register(_close_at_exit)
        _exit_hook = True
    _LIVE.add(eng)


class Engine(MessagingMixin):
    """One endpoint: its transports' NIC domains, a worker thread and a completion ring.

    The default engine holds one transport per reach (cma for this host, nvlink for this
    node's GPUs, the best network provider for other hosts) and takes, per operation, the
    narrowest that reaches the peer and holds both regions (:meth:`route`); a provider's name
    opens that provider alone. Create it inside a running event loop and close it with
    ``await eng.aclose()`` or ``async with``:

        async with afabric.Engine() as eng:
            mr = eng.register(buf)
            ...

    Args:
        provider: ``"auto"`` (route: the best available provider of each reach, saying why
            in :attr:`provider_choice`), or a provider's name, opened alone: ``"tcp"``,
            ``"shm"``, ``"efa"``, ``"verbs"``, ``"cma"``, ``"nvlink"`` or a plugin's.
            ``$AFABRIC_PROVIDER`` replaces ``"auto"``.
        nic: one NIC by name (``"efa0"``, ``"mlx5_0:1"``, ``"cuda0"``, ``"lo"``); with
            ``"auto"``, the network transport's.
        nics: the NICs of a domain group (names, or how many of the first usable ones);
            large writes are split across them. Every peer must use as many. With
            ``"auto"``, the network transport's.
        bind: the interface address to bind (tcp binds 127.0.0.1 unless given this or a NIC);
            with ``"auto"``, the network transport's.
        cpu: the core the worker thread is pinned to (default: one near the NIC).
        polling: ``"adaptive"`` (spin ``spin_us`` after activity, then sleep) or ``"spin"``
            (never sleep; a core per engine).
        spin_us: how long the worker, and the event loop while it awaits a few operations,
            keep looking after activity before sleeping (0..10,000,000; 0: the loop never polls).
        max_message_size: bytes of one receive buffer (256 B..64 MiB); larger messages are
            sent in fragments.
        op_timeout: seconds without progress before an operation fails with
            :class:`~afabric.errors.OperationTimeout` (0: never).
        rx_depth: receive buffers posted to the provider (1..65535).
        tx_depth: sends and writes the provider may hold at once (1..65535).
        name: the engine's name in logs (logger ``afabric.engine.<name>``).
        timing: stamp every operation's stages in the shim (read with :meth:`timings`).
        allow_peers: only these peers may reach this engine, and only these are reached
            (:meth:`allow_peers`); None: every peer.
        max_queued_messages: received messages not yet taken by ``recv`` (0..2**24); beyond
            it senders are held back (or, see :attr:`queue_overflow`, messages dropped).
        max_imm_values: distinct immediate values the counter table holds (1..2**24).
        max_queued_bytes: memory for messages larger than one receive buffer, being received
            or queued (0..2**40).
        peer_stop_timeout: seconds after which a same-host peer whose process is stopped
            (SIGSTOP) is reported down; None: off.
        heartbeat: seconds between keepalives to each peer in use; a peer that answers none
            for ``HEARTBEAT_MISSES`` intervals is reported down; None: off.

    Attributes:
        address: this engine's :class:`afabric.Address`; ``bytes(eng.address)`` is what
            peers need to send to it.
        provider: afabric's provider name (``"tcp"``), or ``"auto"`` for an engine that routes.
        transports: the providers this engine holds, in the order it prefers them.
        fabric_provider: the provider as the native library reports it (``"tcp;ofi_rxm"``;
            joined by ``+`` for an engine that routes).
        provider_choice: why this provider (with ``"auto"``: what was opened and passed over).
        nics: NICs in this engine's group (every transport's together).
        max_message_size: bytes of one receive buffer.
        max_write_size: the largest single write (``write_many`` does not split writes).
        queue_overflow: ``"backpressure"`` or ``"drop"``: what a message meets when
            ``max_queued_messages`` are queued.
        allowed_peers: the allow-list, or None.
        op_timeout: seconds without progress before an operation fails.
        name: the engine's name in logs.

    Raises:
        UsageError: no event loop is running in this thread.
        InvalidArgument: an argument outside the range given above.
        ProviderUnavailable: the provider is not installed or sees no usable NIC.
        PluginError: the provider's plugin is broken.
        ShimLoadError: the C shim could not be loaded.
        TransportError: the provider failed to open its domain.
    """

    def __init__(
        self,
        provider: str = "auto",
        *,
        nic: str | None = None,
        nics: Sequence[str] | int | None = None,
        bind: str | None = None,
        cpu: int | None = None,
        polling: str = "adaptive",
        spin_us: int = 50,
        max_message_size: int = 65536,
        op_timeout: float = 20.0,
        rx_depth: int = 128,
        tx_depth: int = 256,
        name: str | None = None,
        timing: bool = False,
        allow_peers: Sequence[Address | bytes] | None = None,
        max_queued_messages: int = 1024,
        max_imm_values: int = 65536,
        max_queued_bytes: int = 1 << 30,
        peer_stop_timeout: float | None = None,
        heartbeat: float | None = None,
    ) -> None:
        self._closed = True  # until fully open: __del__ must not touch half-made state
        self._forked = False
        try:
            self._loop = asyncio.get_running_loop()
        except RuntimeError:
            raise errors.UsageError("create an Engine inside a running event loop (async def ...)") from None
        self._thread = threading.get_ident()  # the loop's thread: the only one that may call
        self._pid = os.getpid()
        self._check_modes(provider, polling, op_timeout)
        # checked here: ctypes would silently truncate these into the config's 32-bit fields
        _bounded(spin_us, "spin_us", 0, 10_000_000)
        # While it awaits a few operations the loop looks at the ring itself until spin_us
        # passed without a completion (_poll_tick): no eventfd write, no epoll wake-up.
        self._poll_window, self._poll_slice_ns = spin_us / 1e6, min(_POLL_SLICE_NS, spin_us * 1000)
        # _inline_ok's run; _resuming: a drain resolved several operations and their tasks
        # have yet to run (_resume): one of them that submits is not alone, its look would
        # hold the others up (nor does _poll_tick wait a slice for them)
        self._polling, self._inline_left, self._resuming = False, _INLINE_RUN, False
        # how long _alone's look lasts
        self._take_ns, self._poll_last = min(spin_us * 1000, _TAKE_MAX_NS), 0.0
        self._polled = self._woken = 0  # stats(): loop_polled, loop_woken
        self._check_sizes(max_message_size, rx_depth, tx_depth, max_queued_messages, max_imm_values,
                          max_queued_bytes, cpu)
        nic_choice = self._nic_choice(nic, nics)
        named = bind is not None or nic is not None or nics is not None
        routed = provider == "auto" and registry.env_provider() is None
        transports: _native.TransportArray | None = None
        if routed:
            specs, why = registry.routes()
            spec, transports = specs[0], self._transport_configs(specs, nic_choice, bind if named else None)
        else:
            spec, why = registry.resolve(provider)
        self.provider: str = "auto" if routed else spec.name
        """afabric's provider name ("tcp"), or "auto" for an engine that routes per peer."""
        self.provider_choice: str = why
        """Why this provider: with provider="auto", what was picked and what was passed over."""
        cfg = _native.make_config(
            library=spec.library,
            provider_name=self.provider,
            fabric_provider=spec.fabric_provider,
            nics=nic_choice,
            # the provider's default bind (tcp: loopback) applies only when no NIC is named
            bind_addr=bind if named else spec.bind_addr,
            cpu=-1 if cpu is None else cpu,
            spin=polling == "spin",
            spin_us=spin_us,
            max_msg_size=max_message_size,
            rx_depth=rx_depth,
            tx_depth=tx_depth,
            op_timeout=op_timeout,
            force_efa_modes=testing.efa_modes_forced(),  # a testing hook, not API
            timing=timing,
            max_imm_values=max_imm_values,
        )
        cfg.peer_stop_ms = stop_ms(peer_stop_timeout)
        cfg.heartbeat_ms = heartbeat_ms(heartbeat)
        self._max_queued = max_queued_messages
        self._init_messages(max_queued_bytes)
        self._max_imm_values = max_imm_values
        self._n = _native.NativeEngine(cfg, self.provider, transports)
        try:
            self._adopt(self.provider, why, name, op_timeout)
        except BaseException:
            self._n.destroy()
            raise
        if allow_peers is not None:
            try:
                self.allow_peers(allow_peers)
            except BaseException:
                self.close()
                raise

    def _adopt(self, provider: str, why: str, name: str | None, op_timeout: float) -> None:
        """The rest of construction, once the native engine exists (which `__init__`
        destroys again if this raises)."""
        facts = self._n.facts()
        self._fd = int(facts.event_fd)
        self.fabric_provider: str = facts.provider.decode(errors="replace")
        """The provider as the native library reports it ("tcp;ofi_rxm")."""
        self.max_message_size: int = int(facts.max_msg_size)
        self.max_write_size: int = int(facts.max_write_size)
        self.caps: int = int(facts.caps)
        self._transports = [self._n.transport(i) for i in range(int(facts.transports))]
        # _resume: where the target's worker must copy a write, its round trip is longer than
        # what the loop spends on a future; where the writer copies (cma), shorter. A routed
        # engine goes by its preferred transport, which carries its same-host traffic.
        self._resume_apart = bool(self._transports[0].caps & _native.CAP_TARGET_COPIES)
        self.nics: int = int(facts.nics)
        """NICs in this engine's group (contiguous writes are split across them); every
        transport's together on an engine that routes."""
        self.transports: tuple[str, ...] = tuple(t.name for t in self._transports)
        """The transports this engine holds, in the order it prefers them ("cma", "tcp")."""
        self._routed = provider == "auto"
        self._routes_told: set[bytes] = set()  # peers whose route was logged
        self.address: Address = Address(self._n.address())
        self.op_timeout = op_timeout
        self.name = name or f"{provider}-{self.address.short()}"
        self.log = logging.getLogger(f"afabric.engine.{self.name}")
        self._ops: dict[int, Op] = {}
        self._held: dict[int, tuple[Any, ...]] = {}
        self._regions: dict[int, MemoryRegion] = {}  # registered: held until deregister/close
        # libfabric 1.17's tcp;ofi_rxm crashes (NULL msg_ep in its rendezvous read) when a
        # withheld receive is finally posted and matches a rendezvous message (> its 16 KiB
        # eager size) whose sender has gone meanwhile (every run: 600 x 64 KiB, sender exits,
        # then recv(); 1,500 x 16,384 B never). Where senders may use rendezvous, the queue's
        # overflow is dropped instead: counted, logged, the buffer reposted at once.
        eager = _int_env("FI_OFI_RXM_BUFFER_SIZE", 16384)
        rndv = "ofi_rxm" in self.fabric_provider and self.max_message_size > eager
        self.queue_overflow: str = "drop" if rndv else "backpressure"
        """What a message that finds max_queued_messages queued meets (docs/guide/messages.md)."""
        self._remotes: dict[bytes, int] = {}
        # A descriptor keeps the remote id it was imported as (MrDesc._rid) with this token;
        # a new token (allow_peers, an eviction) makes every such shortcut stale at once.
        self._rtoken = object()
        # While _remote_ids prepares a call naming many descriptors, ids evicted from
        # _remotes wait here until that call went into the shim (it may name them).
        self._evicted: list[int] | None = None
        self._peers: dict[bytes, int] = {}
        self.allowed_peers: tuple[Address, ...] | None = None
        """The allow-list (:meth:`allow_peers`); None: every peer."""
        self._next_imm = 0
        self._watchers: dict[int, UvmWatcher] = {}
        self._peer_hub = PeerHub()
        self._timings_dropped = 0
        self._first_posts: collections.deque[tuple[int, int]] | None = None  # benchmarks
        self._created_at = traceback.format_stack() if self._loop.get_debug() else None
        self._wref = weakref.ref(self)
        self._loop.add_reader(self._fd, _on_ready, self._wref)
        self._closed = False
        self._stuck: errors.AfabricError | None = None  # why the engine closed itself
        _track(self)
        self.log.info("engine open: provider %s (%s); %s", self.provider, self.fabric_provider, why)

    @staticmethod
    def _check_modes(provider: Any, polling: Any, op_timeout: Any) -> None:
        if polling not in ("adaptive", "spin"):
            raise errors.InvalidArgument(f"polling must be 'adaptive' or 'spin', got {polling!r}")
        if not isinstance(provider, str):
            raise errors.InvalidArgument("provider must be a string")
        if (
            isinstance(op_timeout, bool)
            or not isinstance(op_timeout, (int, float))
            or not 0 <= op_timeout < 1e9
        ):
            raise errors.InvalidArgument("op_timeout must be a number of seconds >= 0 (0 = never)")

    @staticmethod
    def _check_sizes(max_message_size: int, rx_depth: int, tx_depth: int, max_queued_messages: int,
                     max_imm_values: int, max_queued_bytes: int, cpu: int | None) -> None:
        _bounded(max_message_size, "max_message_size", 256, 64 << 20)  # room for messages.py's header
        _bounded(rx_depth, "rx_depth", 1, 65535)
        _bounded(tx_depth, "tx_depth", 1, 65535)
        # received messages nobody took with recv() yet (beyond: back-pressure), and distinct
        # immediate values counted (beyond: new values dropped); docs/configuration.md
        _bounded(max_queued_messages, "max_queued_messages", 0, 1 << 24)
        _bounded(max_imm_values, "max_imm_values", 1, 1 << 24)
        _bounded(max_queued_bytes, "max_queued_bytes", 0, 1 << 40)  # large messages held (_messaging)
        if cpu is not None:
            _bounded(cpu, "cpu", 0, 1 << 20)

    @classmethod
    def _transport_configs(
        cls, specs: list[ProviderSpec], nic_choice: str | Sequence[str] | int | None, bind: str | None
    ) -> _native.TransportArray:
        """A routed engine's transports: the NIC and bind arguments are its network one's."""
        count = nic_choice if isinstance(nic_choice, int) else 0
        return _native.make_transports([
            (
                s.library, s.name, s.fabric_provider,
                cls._nic_names(nic_choice) if s.reach == "network" else None,
                bind if s.reach == "network" and bind is not None else s.bind_addr,
                s.reach,
                count if s.reach == "network" else 0,
            )
            for s in specs
        ])

    @staticmethod
    def _nic_names(choice: str | Sequence[str] | int | None) -> str | None:
        """NIC names as the shim's configuration takes them (comma-separated)."""
        if choice is None or isinstance(choice, int):
            return None
        names = [choice] if isinstance(choice, str) else list(choice)
        if not names or any(not n or "," in n for n in names):
            raise errors.InvalidArgument(f"bad NIC names {names!r}")
        return ",".join(names)

    @staticmethod
    def _nic_choice(nic: str | None, nics: Sequence[str] | int | None) -> str | Sequence[str] | int | None:
        """``nic``: one NIC by name; ``nics``: the NIC names of the group (every peer must
        use as many), or how many of the first usable ones."""
        if nic is not None and nics is not None:
            raise errors.InvalidArgument("give nic= or nics=, not both")
        if isinstance(nics, bool):
            raise errors.InvalidArgument("nics must be NIC names or a count")
        if isinstance(nics, int) and not 1 <= nics <= 8:
            raise errors.InvalidArgument(f"nics={nics}: a group has 1..8 NICs")
        if nic is not None:
            return nic
        if nics is None or isinstance(nics, (int, str)):
            return nics
        return list(nics)

    # ---- lifetime ----

    async def __aenter__(self) -> Engine:
        self._check_loop()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def closed(self) -> bool:
        """True once the engine is closed (by :meth:`close`, :meth:`aclose`, or
        itself after :class:`~afabric.errors.EngineStuck`).
        """
        return self._closed

    async def aclose(self, timeout: float | None = None) -> None:
        """Close gracefully: wait (bounded) for writes, reads and sends in flight, then release
        everything. Idempotent; aborts on error or cancellation.

        Args:
            timeout: seconds to wait for operations in flight (default: ``op_timeout``).

        Raises:
            UsageError: called from another thread or event loop.
        """
        if self._closed:
            self.close()  # after fork: releases the child's copies
            return
        self._check_loop()
        wait = [
            fut
            for fut, _, _, _, kind in self._ops.values()
            if kind in ("write", "read", "send") and not fut.done()
        ]
        try:
            if wait:
                limit = timeout if timeout is not None else (self.op_timeout or None)
                await asyncio.wait(wait, timeout=limit)
        finally:
            self.close()

    def close(self) -> None:
        """Abort: fail everything pending with EngineClosed and release native resources.

        Safe to call from finalizers and more than once; never awaits. In a child process that
        inherited the engine through fork it only drops the child's copies (Python state, the
        eventfd).
        """
        if self._forked:
            self._release_inherited()
            return
        if self._closed:
            return
        if threading.get_ident() != self._thread and not self._loop.is_closed():
            self._refuse()
        self._shut(errors.EngineClosed("engine closed while the operation was in flight"))

    def _shut(self, exc: errors.AfabricError) -> None:
        """Close, failing what is pending with ``exc``."""
        self._closed = True
        _tell_closed_in_process(self)
        with contextlib.suppress(RuntimeError, ValueError, OSError):  # loop already closed
            self._loop.remove_reader(self._fd)
        try:
            self._n.destroy()
        except BaseException:
            # the worker was detached, not stopped: its NIC may still write into these
            refs = [op_refs for _, _, _, op_refs, _ in self._ops.values()]
            _ABANDONED.append((self._regions, dict(self._held), refs))
            self._regions = {}
            raise
        finally:
            self._fail_all(exc)
        regions, self._regions = self._regions, {}
        for mr in regions.values():
            mr._unpin()

    def _release_inherited(self) -> None:
        """Close in a forked child: never the native engine (its worker thread does not
        exist here) and never the loop's epoll set (shared with the parent: removing the
        eventfd there would remove it for the parent too). Closing the child's copy of the
        eventfd leaves the parent's registration alone (epoll keys on the open file)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            watcher._engine_closed()
        self._ops = {}
        self._held = {}
        self._regions = {}
        self._recv_waiters.clear()
        self._inbox.clear()
        self._held_rx.clear()

    def _fail_all(self, exc: errors.AfabricError) -> None:
        self._peer_hub.close()
        watchers, self._watchers = self._watchers, {}
        for watcher in watchers.values():
            watcher._engine_closed()
        ops, self._ops = self._ops, {}
        self._held.clear()
        for fut, *_ in ops.values():
            if not fut.done() and not fut.get_loop().is_closed():
                fut.set_exception(exc)
                fut.exception()  # mark retrieved: nobody may await it any more
        self._fail_messages(exc)

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        if threading.get_ident() != self._thread:  # collected on another thread
            with contextlib.suppress(Exception):
                self._loop.call_soon_threadsafe(self.__del__)
                return
        msg = f"unclosed afabric.Engine {getattr(self, 'name', '?')}"
        if self._created_at:
            msg += "\ncreated at:\n" + "".join(self._created_at)
        warnings.warn(msg, ResourceWarning, source=self, stacklevel=1)
        with contextlib.suppress(Exception):  # a finalizer must not raise
            self.close()

    def _check_open(self) -> None:
        """For calls that do not await: the engine is open and this is its loop's thread."""
        if self._closed or _get_ident() != self._thread:
            self._refuse()

    def _check_loop(self) -> None:
        """For coroutines: the engine is open and this runs on its own loop (its thread,
        and that loop is running: one loop runs per thread). Not asyncio's
        _get_running_loop(): it makes a getpid() system call each time."""
        if self._closed or _get_ident() != self._thread or not self._loop.is_running():
            self._refuse()

    def _refuse(self) -> NoReturn:
        if self._forked:
            raise errors.UsageError(
                f"engine {self.name} belongs to process {self._pid}; this process inherited it "
                "through fork and cannot use it (create an engine here)"
            )
        if self._closed:
            why = f" (it closed itself: {self._stuck})" if self._stuck else ""
            raise errors.EngineClosed(f"engine {self.name} is closed{why}")
        if threading.get_ident() != self._thread:
            raise errors.UsageError(
                f"engine {self.name} belongs to its event loop's thread, not this thread; from another "
                "thread hand the call to that loop (asyncio.run_coroutine_threadsafe, call_soon_threadsafe)"
            )
        raise errors.UsageError(f"engine {self.name} belongs to another event loop (its own is not running)")

    def stats(self) -> EngineStats:
        """Counters of this engine and of each NIC of its group.

        Per NIC: work requests and bytes posted, sends, receives, immediates in, completions,
        errors, "try again" retries, remote writes seen landing, ``outstanding`` (work requests
        still with the provider), ``rejected`` / ``rejected_unknown`` (dropped by the allow-list),
        ``imms_dropped`` (a new immediate value found ``max_imm_values`` values counted). Per
        engine: operations in flight, the received-message queue, ``loop_polled`` /
        ``loop_woken`` (completions found by the loop's own look / after an eventfd wake-up) and
        ``worker_naps``. Cheap: read it as often as you like.

        Returns:
            The counters; :class:`afabric.EngineStats` lists every key.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
        """
        self._check_open()
        nics: list[NicStats] = []
        for t in self._transports:
            for k in range(t.first_nic, t.first_nic + t.nics):
                nic = cast(NicStats, self._n.stats(k))
                nic["transport"] = t.name
                nics.append(nic)
        return {
            "provider": self.provider,
            "fabric_provider": self.fabric_provider,
            "transports": list(self.transports),
            "ops_in_flight": len(self._ops),
            "buffers_held": len(self._held),
            **self._message_stats(),
            "max_imm_values": self._max_imm_values,
            "loop_polled": self._polled,
            "loop_woken": self._woken,
            "worker_naps": self._n.worker_naps(),
            "nics": nics,
        }

    def timings(self) -> list[OpTiming]:
        """Stage timestamps of the operations completed since the last call.

        Only engines created with ``timing=True`` record them; the shim keeps the newest 65,536
        (a warning is logged when older ones were dropped).

        Returns:
            One record per operation, an :class:`afabric.OpTiming` (its enqueue, worker
                pickup, first and last post and completion times).

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
        """
        self._check_open()
        records, dropped = self._n.timings()
        if dropped > self._timings_dropped:
            self.log.warning(
                "%d timing records were dropped (drain timings() more often)", dropped - self._timings_dropped
            )
            self._timings_dropped = dropped
        return [OpTiming.from_record(r) for r in records]

    # ---- memory ----

    def register(self, buf: Any, *, remote: bool | str = True) -> MemoryRegion:
        """Register memory so that it can be a source, a target or a read destination.

        The engine holds the buffer until :meth:`deregister` or close, and keeps it from moving
        (growing a bytearray or resizing an array raises while it is registered).

        Args:
            buf: a numpy array, bytearray, memoryview, CPU or CUDA torch tensor, or CuPy array
                (contiguous; read-only memory only with ``remote=False`` or ``"r"``).
            remote: what peers holding the descriptor may do: ``"w"`` write (``True``, the
                default), ``"r"`` read, ``"rw"`` both; ``False`` registers for local use only
                (sources, send buffers, read destinations): no descriptor.

        Returns:
            The region; ``mr.descriptor`` is what a peer needs to reach it.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
            InvalidArgument: ``buf`` is not contiguous memory, holds Python objects, is read-only
                but asked to be writable, or ``remote`` is not one of the values above.
            RegistrationError: the provider cannot register this memory (e.g. CUDA memory on a
                provider without device support).
        """
        self._check_open()
        access = _access(remote)
        return self._register_span(span_of(buf, "w" in access), access)

    def register_ptr(
        self, ptr: int, length: int, device: int = -1, *, remote: bool | str = True, owner: Any = None
    ) -> MemoryRegion:
        """Register raw memory by address.

        Args:
            ptr: the first byte's address.
            length: bytes.
            device: the CUDA device the memory lives on; -1 for host memory.
            remote: as in :meth:`register`.
            owner: an object kept referenced while the region is registered (the memory's owner).

        Returns:
            The region.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
            InvalidArgument: ``ptr`` or ``length`` is not a u64, or ``remote`` is invalid.
            RegistrationError: the provider cannot register this memory.
        """
        self._check_open()
        access = _access(remote)
        span = BufferSpan(_u64(ptr, "ptr"), _u64(length, "length"), int(device), owner)
        return self._register_span(span, access)

    def _register_span(self, span: BufferSpan, access: str) -> MemoryRegion:
        flags = (
            (_native.MR_REMOTE if "w" in access else 0)
            | (_native.MR_REMOTE_READ if "r" in access else 0)
            | (_native.MR_DEVICE if span.device >= 0 else 0)
        )
        try:
            mr_id, blob = self._n.register(span.address, span.length, flags, span.device)
        except (errors.Unsupported, errors.TransportError) as e:
            where = "host memory" if span.device < 0 else f"CUDA memory (device {span.device})"
            raise errors.RegistrationError(f"provider {self.provider} cannot register {where}: {e}") from e
        desc = MrDesc(blob) if access else None
        mr = MemoryRegion(self, mr_id, span, access, desc)
        self._regions[mr_id] = mr
        return mr

    def deregister(self, mr: MemoryRegion) -> None:
        """Revoke remote access at once and stop holding the buffer.

        Operations in flight from this region keep its buffer referenced until they complete. On
        libfabric providers it returns only once remote writes accepted before the revocation
        stopped landing (50 ms without one, 2 s at most): see the security page.

        Args:
            mr: a region of this engine.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
            InvalidArgument: ``mr`` is not a MemoryRegion.
            StaleRegion: ``mr`` was deregistered already or belongs to another engine.
        """
        self._check_open()
        if not isinstance(mr, MemoryRegion):
            raise errors.InvalidArgument(f"deregister takes a MemoryRegion, got {type(mr).__name__}")
        mr_id = mr.check(self)
        mr.id = None
        self._n.deregister(mr_id)  # if this raises, the engine keeps the buffer until close
        self._regions.pop(mr_id, None)

    # ---- descriptors and peers ----

    def allow_peers(self, peers: Sequence[Address | bytes] | None, *, accept_unknown: bool = False) -> None:
        """Accept messages and immediates only from these peers, and reach only them.

        Takes effect at once, also for peers resolved before. The shim's worker enforces it: a
        dropped message or immediate never reaches Python (``stats()``: ``rejected``). One whose
        sender the provider cannot name (tcp on libfabric 1.x: every immediate) is dropped too
        while a list is set (``rejected_unknown``). It cannot stop a one-sided write from a peer
        holding one of this engine's remote keys.

        Args:
            peers: the allowed addresses (``Address`` or its bytes); None allows every peer.
            accept_unknown: let through what the provider cannot name a sender for.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
            InvalidArgument: ``peers`` is not a list of addresses.
            BadDescriptor: an address blob is malformed.
        """
        self._check_open()
        if not isinstance(accept_unknown, bool):
            raise errors.InvalidArgument("accept_unknown must be a bool")
        if peers is None:
            self._n.allow_peers(None)
            self.allowed_peers = None
            return
        if isinstance(peers, (Address, bytes, bytearray, memoryview, str)):
            raise errors.InvalidArgument("allow_peers takes a list of addresses (or None)")
        addrs: list[Address] = []
        for a in peers:
            if isinstance(a, Address):
                addrs.append(a)
            elif isinstance(a, (bytes, bytearray, memoryview)):
                addrs.append(Address.from_bytes(a))
            else:
                raise errors.InvalidArgument(f"allow_peers: an Address or bytes, got {type(a).__name__}")
        self._n.allow_peers([bytes(a) for a in addrs], accept_unknown)
        self.allowed_peers = tuple(addrs)
        # resolved peers and imported descriptors are looked up again (and checked again);
        # operations already submitted carry their own copies
        self._peers.clear()
        remotes, self._remotes = self._remotes, {}
        self._rtoken = object()
        for rid in remotes.values():
            self._n.release_remote(rid)

    def _remote(self, desc: Any) -> tuple[int, int]:
        if not isinstance(desc, MrDesc):
            if isinstance(desc, (bytes, bytearray, memoryview)):
                desc = MrDesc.from_bytes(desc)
            else:
                raise errors.InvalidArgument(
                    f"remote descriptor must be an MrDesc, got {type(desc).__name__}"
                )
        cached = desc._rid
        if cached is not None and cached[0] is self._rtoken:
            return cached[1], desc.incarnation
        blob = bytes(desc)
        rid = self._remotes.get(blob)
        if rid is None:
            rid = self._n.import_descriptor(blob)
            if len(self._remotes) >= _REMOTE_CACHE_MAX:
                old_blob = next(iter(self._remotes))
                self._rtoken = object()  # the evicted id may sit in some descriptor's _rid
                old_rid = self._remotes.pop(old_blob)
                if self._evicted is None:
                    self._n.release_remote(old_rid)
                else:
                    self._evicted.append(old_rid)
            self._remotes[blob] = rid
        desc._rid = (self._rtoken, rid)
        return rid, desc.incarnation

    def _remote_ids(self, descs: list[Any]) -> npt.NDArray[np.uint64]:
        """Remote ids for one call naming many descriptors, all live until the caller's
        _release_evicted() after that call (more descriptors than the cache holds, or
        one the call named earlier evicted by a later one, would else be released)."""
        self._evicted = []
        try:
            return np.fromiter((self._remote(d)[0] for d in descs), dtype=np.uint64, count=len(descs))
        except BaseException:
            self._release_evicted()
            raise

    def _release_evicted(self) -> None:
        evicted, self._evicted = self._evicted or [], None
        for rid in evicted:
            self._n.release_remote(rid)

    def _peer(self, address: Any) -> tuple[int, int]:
        if not isinstance(address, Address):
            if isinstance(address, (bytes, bytearray, memoryview)):
                address = Address.from_bytes(address)
            else:
                raise errors.InvalidArgument(f"peer must be an Address, got {type(address).__name__}")
        blob = bytes(address)
        pid = self._peers.get(blob)
        if pid is None:
            pid = self._n.resolve_peer(blob)
            self._peers[blob] = pid
            self._by_handle[self._n.peer_handle(pid)] = address  # a message's sender (_messaging)
            if self._routed:
                self._tell_route(pid, address)
        return pid, address.incarnation

    def _tell_route(self, pid: int, address: Address) -> None:
        """Logs once per peer which transport carries host memory to it, and why a
        preferred one does not (never a silent fallback)."""
        if bytes(address) in self._routes_told:
            return
        self._routes_told.add(bytes(address))
        try:
            index, refused = self._n.peer_route(pid, -1)
        except errors.AfabricError as e:
            self.log.info("route to %r: none for host memory: %s", address, e)
            return
        name = self._transports[index].name
        if refused:
            self.log.info("route to %r: %s (%s)", address, name, refused)
        else:
            self.log.info("route to %r: %s", address, name)

    def route(self, peer: Address | bytes, *, device: int | None = None) -> str:
        """The transport this engine uses to ``peer``: for host memory, or with ``device``
        for CUDA memory (a GPU of the peer's process).

        Args:
            peer: the peer's address.
            device: None for host memory, else a CUDA device index.

        Returns:
            The transport's provider name ("cma", "nvlink", "tcp", ...); a single-provider
                engine names its provider for every peer it reaches.

        Raises:
            WrongProvider: no transport of this engine matches the peer's (with why).
            PeerUnreachable: every transport that matches refused the peer (with why).
            Unsupported: none that reaches the peer holds memory of that kind.
            InvalidArgument: ``peer`` is not an address, or ``device`` not a device index.
            BadDescriptor: the address is malformed.
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
        """
        self._check_open()
        if device is not None:
            _bounded(device, "device", 0, 1 << 16)
        pid, _ = self._peer(peer)
        index, _ = self._n.peer_route(pid, -1 if device is None else device)
        return self._transports[index].name

    def _learn(self, blob: bytes) -> None:
        """An engine that resolved this one said hello (shim/keepalive.c): resolved in turn,
        so that this engine's goodbye reaches it when it closes. One that cannot be (another
        provider, not on the allow-list, restarted, malformed) is left alone."""
        try:
            self._peer(Address.from_bytes(blob))
        except (errors.AfabricError, ValueError) as e:
            self.log.debug("hello from %s not learned: %s", blob[:16].hex(), e)

    # ---- operations ----

    async def _wait(
        self, op_id: int, verb: str, peer: int, refs: tuple[Any, ...], kind: str, when: Trigger | None = None
    ) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        self._ops[op_id] = (fut, verb, peer, refs, kind)
        if self._poll_window and len(self._ops) <= _POLL_MAX_IN_FLIGHT:
            if not self._polling:
                self._start_poll()
            if when is None and len(self._ops) == 1 and not self._resuming and self._inline_ok():
                self._look_inline(fut)
        # If the awaiting task is cancelled the op stays in _ops, keeping `refs` (the
        # buffers) alive until the native completion: the NIC may still be reading them.
        # A triggered op that has not fired yet is disarmed instead (the shim answers the
        # cancel with ECANCELED if it was still armed; a fired one runs to completion).
        if when is None:
            await fut
            return
        try:
            await fut
        except asyncio.CancelledError:
            if not self._closed and op_id in self._ops:
                self._n.cancel(op_id)
            raise

    async def write(
        self,
        mr: MemoryRegion,
        remote_desc: MrDesc,
        length: int,
        src_offset: int = 0,
        dst_offset: int = 0,
        imm: int | None = None,
        when: Trigger | None = None,
        length_from: LengthFrom | None = None,
    ) -> None:
        """One-sided write of ``length`` bytes from ``mr`` into the remote region.

        With ``imm`` the target counts one arrival of it, after the data is in place; a zero
        ``length`` with an immediate is an immediate-only write. Writes are unordered with
        respect to each other.

        Args:
            mr: the local source region (any access, ``remote=False`` included).
            remote_desc: the target region's descriptor (or its bytes).
            length: bytes to write; at most ``max_write_size``.
            src_offset: where in ``mr`` the bytes start.
            dst_offset: where in the remote region they land.
            imm: a 32-bit immediate value to count at the target, or None.
            when: post it from the shim once this trigger holds (a watcher value or an
                immediate count) instead of now; cancelling the await disarms it.
            length_from: read the actual length from memory when the write starts;
                ``length`` is then the maximum.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            ImmediateOutOfRange: ``imm`` is outside 0..2**32-1.
            MessageTooLarge: ``length`` is above ``max_write_size``.
            StaleRegion: ``mr`` was deregistered, or ``remote_desc`` is from a restarted peer.
            BadDescriptor: ``remote_desc`` is truncated or corrupted.
            WrongProvider: ``remote_desc`` comes from an engine of another provider.
            PeerNotAllowed: the target is not on the allow-list.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        # The per-call path is inlined (submit cost, docs/internals/architecture.md):
        # the same checks as _check_loop, _remote, _u64, _imm and _trigger, in that order.
        if self._closed or _get_ident() != self._thread or not self._loop.is_running():
            self._refuse()
        if not isinstance(mr, MemoryRegion):
            raise errors.InvalidArgument(f"write source must be a MemoryRegion, got {type(mr).__name__}")
        mr_id = mr.id  # live and ours (the engine is open: checked above), else mr.check raises
        if mr_id is None or mr._engine() is not self:
            mr_id = mr.check(self)
        if isinstance(remote_desc, MrDesc) and (c := remote_desc._rid) is not None and c[0] is self._rtoken:
            rid, peer = c[1], remote_desc.incarnation
        else:
            rid, peer = self._remote(remote_desc)
        if not (
            type(length) is int and type(src_offset) is int and type(dst_offset) is int
            and 0 <= length <= U64_MAX and 0 <= src_offset <= U64_MAX and 0 <= dst_offset <= U64_MAX
        ):  # fmt: skip
            length = _u64(length, "length")
            src_offset = _u64(src_offset, "src_offset")
            dst_offset = _u64(dst_offset, "dst_offset")
        imm_v = _NO_IMM if imm is None else _imm(imm)
        if when is None and length_from is None:
            if not self._ops and self._poll_window and self._first_posts is None and not self._resuming:
                alone = self._alone(
                    "write", _OP_WRITE, mr, peer, mr_id, rid, length, src_offset, dst_offset, imm_v
                )
                if alone is not None:
                    await alone  # cancelled: the op stays in _ops, keeping mr alive (see _wait)
                return
            op = self._n.write("write", mr_id, rid, length, src_offset, dst_offset, imm_v)
            fut: asyncio.Future[None] = self._loop.create_future()
            self._ops[op] = (fut, "write", peer, (mr,), "write")
            if not self._polling and self._poll_window and len(self._ops) <= _POLL_MAX_IN_FLIGHT:
                self._start_poll()
            await fut  # cancelled: the op stays in _ops, keeping mr alive (see _wait)
            return
        args = (mr_id, rid, length, src_offset, dst_offset, imm_v)
        if length_from is None:
            op = self._n.write("write", *args, self._trigger(when))
            await self._wait(op, "write", peer, (mr,), "write", when)
            return
        lf = length_from
        if not isinstance(lf, LengthFrom):
            raise errors.InvalidArgument(f"length_from must be a LengthFrom, got {type(lf).__name__}")
        word = (lf.region.check(self), lf.offset, lf.base, lf.scale)
        op = self._n.write_dynlen("write", *args, word, self._trigger(when))
        await self._wait(op, "write", peer, (mr, lf.region), "write", when)

    async def write_paged(
        self,
        mr: MemoryRegion,
        remote_desc: MrDesc,
        *,
        page_len: int,
        src_pages: Pages,
        dst_pages: Pages,
        imm: int | None = None,
        when: Trigger | None = None,
    ) -> None:
        """Write page ``src_pages[i]`` of ``mr`` to page ``dst_pages[i]`` of the remote region, for every i.

        One call into the shim whatever the page count; pages are spread over the group's NICs.

        Args:
            mr: the local source region.
            remote_desc: the target region's descriptor.
            page_len: bytes per page.
            src_pages: the source pages (indices, stride, offset) in ``mr``.
            dst_pages: the destination pages in the remote region; as many as ``src_pages``.
            imm: an immediate the target counts once per page, or None.
            when: post it from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        if not isinstance(mr, MemoryRegion):
            raise errors.InvalidArgument(f"write source must be a MemoryRegion, got {type(mr).__name__}")
        if not isinstance(src_pages, Pages) or not isinstance(dst_pages, Pages):
            raise errors.InvalidArgument("src_pages and dst_pages must be afabric.Pages")
        if len(src_pages) != len(dst_pages):
            raise errors.InvalidArgument(
                f"{len(src_pages)} source pages but {len(dst_pages)} destination pages"
            )
        mr_id = mr.check(self)
        rid, peer = self._remote(remote_desc)
        op = self._n.write_paged(
            "paged write", mr_id, rid, _u64(page_len, "page_len"),
            src_pages.indices, src_pages.stride, src_pages.offset,
            dst_pages.indices, dst_pages.stride, dst_pages.offset, _imm(imm), self._trigger(when),
        )  # fmt: skip
        await self._wait(op, "paged write", peer, (mr,), "write", when)

    async def scatter(
        self,
        mr: MemoryRegion,
        targets: Sequence[ScatterTarget],
        *,
        group: PeerGroup | None = None,
        imm: int | None = None,
        when: Trigger | None = None,
    ) -> None:
        """One write per target, all in one call into the shim (targets spread over the group's NICs).

        Args:
            mr: the local source region.
            targets: where each piece goes (:class:`afabric.ScatterTarget`: descriptor, length,
                source and destination offsets).
            group: the targets' peers resolved once (:meth:`peer_group`), or None.
            imm: an immediate each target counts once, or None.
            when: post it from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        if not isinstance(mr, MemoryRegion):
            raise errors.InvalidArgument(f"scatter source must be a MemoryRegion, got {type(mr).__name__}")
        targets = list(targets)
        if not all(isinstance(t, ScatterTarget) for t in targets):
            raise errors.InvalidArgument("scatter targets must be afabric.ScatterTarget")
        descs = [t.desc for t in targets]
        if group is not None:
            group.check(descs)
        mr_id = mr.check(self)
        n = len(targets)
        lengths, src, dst = _target_columns(targets)
        value, trig = _imm(imm), self._trigger(when)
        ids = self._remote_ids(descs)
        try:
            op = self._n.scatter("scatter", mr_id, ids, lengths, src, dst, value, trig)
        finally:
            self._release_evicted()
        await self._wait(op, f"scatter to {n} targets", 0, (mr,), "write", when)

    async def write_many(
        self,
        mr: MemoryRegion,
        remote_desc: MrDesc | Sequence[MrDesc],
        lengths: int | Sequence[int] | npt.NDArray[np.integer[Any]],
        src_offsets: int | Sequence[int] | npt.NDArray[np.integer[Any]] = 0,
        dst_offsets: int | Sequence[int] | npt.NDArray[np.integer[Any]] = 0,
        *,
        imm: int | None = None,
        when: Trigger | None = None,
    ) -> None:
        """Many one-sided writes in one call into the shim and one future.

        Write i moves ``lengths[i]`` bytes from ``src_offsets[i]`` of ``mr`` to ``dst_offsets[i]``
        of ``remote_desc`` (or of ``remote_desc[i]``). Each write is at most ``max_write_size``
        bytes (it is not split); at most 2**24 writes per call. Completes when all have; if any
        fails, it raises once.

        Args:
            mr: the local source region.
            remote_desc: one descriptor for every write, or a sequence with one per write.
            lengths: an int for every write, or one entry per write (a sequence or a 1-D integer
                numpy array).
            src_offsets: the same forms as ``lengths``.
            dst_offsets: the same forms as ``lengths``. At least one argument gives the count.
            imm: an immediate every write counts once at its target (n writes: n arrivals).
            when: post them from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            MessageTooLarge: a write is above ``max_write_size``.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        if not isinstance(mr, MemoryRegion):
            raise errors.InvalidArgument(f"write_many source must be a MemoryRegion, got {type(mr).__name__}")
        many = not isinstance(remote_desc, (MrDesc, bytes, bytearray, memoryview))
        if many and not isinstance(remote_desc, Sequence):
            raise errors.InvalidArgument(
                f"remote_desc must be an MrDesc or a sequence of them, got {type(remote_desc).__name__}"
            )
        args = (("lengths", lengths), ("src_offsets", src_offsets), ("dst_offsets", dst_offsets))
        counts = {name: _column_len(v, name) for name, v in args if not isinstance(v, (int, np.integer))}
        if many:
            counts["remote_desc"] = len(remote_desc)
        if not counts:
            raise errors.InvalidArgument(
                "write_many needs the count: give lengths, offsets or descriptors as sequences"
            )
        n = next(iter(counts.values()))
        if any(c != n for c in counts.values()):
            raise errors.InvalidArgument(
                "write_many: " + ", ".join(f"{k} has {c}" for k, c in counts.items()) + " entries"
            )
        mr_id = mr.check(self)
        cols = [_u64_column(v, name, n) for name, v in args]
        value, trig = _imm(imm), self._trigger(when)
        if many:
            ids = self._remote_ids(list(remote_desc))  # type: ignore[arg-type]
            peer = 0
        else:
            rid, peer = self._remote(remote_desc)
            ids = np.full(n, rid, dtype=np.uint64)
        try:
            op = self._n.scatter("write_many", mr_id, ids, cols[0], cols[1], cols[2], value, trig)
        finally:
            self._release_evicted()
        await self._wait(op, f"write_many ({n} writes)", peer, (mr,), "write", when)

    async def barrier(
        self,
        descs: Sequence[MrDesc],
        imm: int,
        *,
        group: PeerGroup | None = None,
        when: Trigger | None = None,
    ) -> None:
        """An immediate-only write to each region in ``descs``: every target counts one arrival of ``imm``.

        Pair it with ``expect_imm(imm, n)`` on each side.

        Args:
            descs: one descriptor per target region (any of the peer's remote regions).
            imm: the immediate value.
            group: the targets' peers resolved once, or None.
            when: post it from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            ImmediateOutOfRange: ``imm`` is outside 0..2**32-1.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        value = _imm(imm)
        if value == _native.NO_IMM:
            raise errors.ImmediateOutOfRange("barrier needs an immediate value")
        descs = [d if isinstance(d, MrDesc) else MrDesc.from_bytes(d) for d in descs]
        if group is not None:
            group.check(descs)
        trig = self._trigger(when)
        ids = self._remote_ids(descs)
        try:
            op = self._n.scatter("barrier", 0, ids, None, None, None, value, trig)
        finally:
            self._release_evicted()
        await self._wait(op, f"barrier over {len(descs)} peers", 0, (), "write", when)

    # ---- reads (remote -> local): the writes' counterparts, same checks and bookkeeping ----

    def _read_dest(self, mr: Any, what: str) -> int:
        if not isinstance(mr, MemoryRegion):
            raise errors.InvalidArgument(
                f"{what} destination must be a MemoryRegion, got {type(mr).__name__}"
            )
        mr_id = mr.check(self)
        if mr.readonly:
            raise errors.InvalidArgument(f"{what} destination is a read-only buffer: a read writes into it")
        return mr_id

    async def read(
        self,
        mr: MemoryRegion,
        remote_desc: MrDesc,
        length: int,
        src_offset: int = 0,
        dst_offset: int = 0,
        *,
        when: Trigger | None = None,
    ) -> None:
        """One-sided read of ``length`` bytes from the remote region into ``mr``.

        The remote region must have been registered ``remote="r"`` or ``"rw"``. Nothing is
        counted at the target (tell it with a message or an immediate-only write).

        Args:
            mr: the local destination region (any registered region that is writable locally).
            remote_desc: the source region's descriptor.
            length: bytes to read.
            src_offset: where in the remote region the bytes start.
            dst_offset: where in ``mr`` they land.
            when: post it from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        mr_id = self._read_dest(mr, "read")
        rid, peer = self._remote(remote_desc)
        args = (
            mr_id,
            rid,
            _u64(length, "length"),
            _u64(src_offset, "src_offset"),
            _u64(dst_offset, "dst_offset"),
        )
        alone_ok = not self._ops and self._poll_window and self._first_posts is None and not self._resuming
        if when is None and alone_ok:
            alone = self._alone("read", _native.OP_READ, mr, peer, *args, _NO_IMM)
            if alone is not None:
                await alone  # cancelled: the op stays in _ops, keeping mr alive (see _wait)
            return
        op = self._n.read("read", *args, self._trigger(when))
        await self._wait(op, "read", peer, (mr,), "read", when)

    async def read_paged(
        self,
        mr: MemoryRegion,
        remote_desc: MrDesc,
        *,
        page_len: int,
        src_pages: Pages,
        dst_pages: Pages,
        when: Trigger | None = None,
    ) -> None:
        """Read remote page ``src_pages[i]`` into local page ``dst_pages[i]`` of ``mr``, for every i.

        One call into the shim, spread over the group's NICs.

        Args:
            mr: the local destination region.
            remote_desc: the source region's descriptor (readable).
            page_len: bytes per page.
            src_pages: the pages to read in the remote region.
            dst_pages: where they land in ``mr``; as many as ``src_pages``.
            when: post it from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        mr_id = self._read_dest(mr, "paged read")
        if not isinstance(src_pages, Pages) or not isinstance(dst_pages, Pages):
            raise errors.InvalidArgument("src_pages and dst_pages must be afabric.Pages")
        if len(src_pages) != len(dst_pages):
            raise errors.InvalidArgument(
                f"{len(src_pages)} source pages but {len(dst_pages)} destination pages"
            )
        rid, peer = self._remote(remote_desc)
        op = self._n.read_paged(
            "paged read", mr_id, rid, _u64(page_len, "page_len"),
            src_pages.indices, src_pages.stride, src_pages.offset,
            dst_pages.indices, dst_pages.stride, dst_pages.offset, self._trigger(when),
        )  # fmt: skip
        await self._wait(op, "paged read", peer, (mr,), "read", when)

    async def gather(
        self,
        mr: MemoryRegion,
        sources: Sequence[GatherSource],
        *,
        group: PeerGroup | None = None,
        when: Trigger | None = None,
    ) -> None:
        """One read per source, all in one call into the shim (sources spread over the group's NICs).

        Completes when all have; if any fails, it raises once.

        Args:
            mr: the local destination region.
            sources: what to read (:class:`afabric.GatherSource`: descriptor, length, source and
                destination offsets).
            group: the sources' peers resolved once, or None.
            when: post it from the shim once this trigger holds.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread or event loop, or in a forked child.
            InvalidArgument: an argument of the wrong type or value (nothing is posted).
            OutOfRange: a range outside the local or the remote region (nothing is posted).
            StaleRegion: ``mr`` was deregistered or belongs to another engine.
            BadDescriptor: ``remote_desc`` is truncated, corrupted or from a restarted peer.
            PeerNotAllowed: the target is not on the allow-list.
            RemoteKeyRejected: the descriptor's access forbids it (before posting), or the
                target refused the key or range.
            PeerUnreachable: the target's process or engine is gone.
            OperationTimeout: no progress for ``op_timeout`` seconds.
            EngineStuck: the worker stayed inside one provider call too long; the engine closed.
            TransportError: any other failure, with the provider's own text.
        """
        self._check_loop()
        mr_id = self._read_dest(mr, "gather")
        sources = list(sources)
        if not all(isinstance(t, GatherSource) for t in sources):
            raise errors.InvalidArgument("gather sources must be afabric.GatherSource")
        descs = [t.desc for t in sources]
        if group is not None:
            group.check(descs)
        lengths, src, dst = _target_columns(sources)
        trig = self._trigger(when)
        ids = self._remote_ids(descs)
        try:
            op = self._n.gather("gather", mr_id, ids, lengths, src, dst, trig)
        finally:
            self._release_evicted()
        await self._wait(op, f"gather from {len(sources)} sources", 0, (mr,), "read", when)

    def peer_group(self, addresses: Sequence[Address | bytes]) -> PeerGroup:
        """Resolve a set of peers once, for ``group=`` of scatter, barrier and gather.

        Args:
            addresses: the peers' addresses (``Address`` or bytes).

        Returns:
            The resolved group.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
            BadDescriptor: an address is malformed.
            WrongProvider: an address is from another provider.
            PeerNotAllowed: a peer is not on the allow-list.
        """
        self._check_open()
        addrs = [a if isinstance(a, Address) else Address.from_bytes(a) for a in addresses]
        ids = [self._peer(a)[0] for a in addrs]
        return PeerGroup(self, addrs, ids)

    def uvm_watcher(self, device: int | None = None) -> UvmWatcher:
        """A watched 64-bit word that a GPU kernel (or any writer) bumps.

        Args:
            device: a CUDA device whose kernels will bump it (the word is then pinned host memory
                mapped into that device); None: host memory.

        Returns:
            The watcher: ``async for old, new in w``, ``await w.wait_for(v)``, ``w.reaches(v)``
            as a trigger.

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
            Unsupported: CUDA memory is not available for ``device``.
        """
        self._check_open()
        dev = -1 if device is None else int(device)
        try:
            wid, host, devptr = self._n.watcher_create(dev)
        except errors.Unsupported as e:
            raise errors.Unsupported(f"a CUDA watcher needs a CUDA driver: {e}") from e
        w = UvmWatcher(self, wid, host, devptr, dev)
        self._watchers[wid] = w
        return w

    def _forget_watcher(self, w: UvmWatcher) -> None:
        self._watchers.pop(w.id, None)
        self._n.watcher_destroy(w.id)

    def _trigger(self, when: Trigger | None) -> tuple[int, int, int]:
        if when is None:
            return _native.NO_TRIGGER
        if not isinstance(when, Trigger):
            raise errors.InvalidArgument(
                f"when= takes a trigger (watcher.reaches(v), imm_count(i, n)), got {when!r}"
            )
        return when.native()

    def peer_events(self) -> AsyncIterator[PeerEvent]:
        """Peers going up and down, as an async iterator.

        ``async for ev in eng.peer_events()`` yields first the state of every peer known so far,
        then each change, until the engine closes. Nothing needs to be posted: same-host peers'
        processes are watched, closing engines say goodbye, and ``heartbeat`` finds silent ones.

        Returns:
            An async iterator of :class:`afabric.PeerEvent`.
        """
        return self._peer_hub.iterate(self._closed)

    def alloc_imm(self) -> int:
        """A fresh immediate value for one logical operation.

        Returns:
            A value never 0 and not handed out before (wraps after 2**32-1).

        Raises:
            EngineClosed: the engine is closed.
            UsageError: called from another thread.
        """
        self._check_open()
        self._next_imm = self._next_imm % IMM_MAX + 1
        return self._next_imm

    async def expect_imm(self, imm: int, count: int, *, timeout: float | None = None) -> None:
        """Wait until ``count`` arrivals of ``imm`` have been counted, and consume them.

        Arrivals before this call are kept and count. Cancelling (or the timeout) withdraws the
        expectation: arrivals it consumed in a completion that raced the cancel are given back to
        the counter, so none is lost.

        Args:
            imm: the immediate value.
            count: arrivals to wait for.
            timeout: seconds; None waits for ever.

        Raises:
            EngineClosed: the engine is closed (before or while waiting).
            UsageError: called from another thread or event loop.
            ImmediateOutOfRange: ``imm`` is outside 0..2**32-1.
            OutOfRange: ``count`` is negative or too large.
            Busy: another expectation on ``imm`` is pending.
            OperationTimeout: ``timeout`` passed first.
        """
        self._check_loop()
        value = _imm(imm)
        if value == _native.NO_IMM:
            raise errors.ImmediateOutOfRange("expect_imm needs an immediate value, not None")
        n = _u64(count, "count")
        op_id = self._n.expect_imm(value, n)
        fut: asyncio.Future[None] = self._loop.create_future()
        self._ops[op_id] = (fut, f"expect_imm({value}, {n})", 0, (value, n), "expect")
        try:
            if timeout is None:
                await fut
            else:
                await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            self._withdraw(op_id)
            raise errors.OperationTimeout(
                f"expect_imm({value}, {n}): not complete after {timeout} s"
            ) from None
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                self._n.imm_return(value, n)  # it completed as the task was cancelled
            else:
                self._withdraw(op_id)
            raise

    def _withdraw(self, op_id: int) -> None:
        if not self._closed and op_id in self._ops:
            self._n.cancel(op_id)

    # ---- completions ----

    def _inline_ok(self) -> bool:
        """Whether an operation awaited alone may get its first look from the awaiting call:
        at most _INLINE_RUN in a row complete so (their awaits do not suspend), then one
        waits on the loop, so other tasks run at least that often."""
        if self._inline_left > 0:
            return True
        self._inline_left = _INLINE_RUN
        return False

    def _look_inline(self, fut: asyncio.Future[None]) -> None:
        """The first look for an operation awaited alone, from the awaiting call (the poll
        is started: its tick keeps the fd's contract). Found within one poll slice, the
        future is done and ``await`` does not suspend: no loop iteration before the look,
        none between the result and the caller's next line."""
        if self._n.pending_wait(self._poll_slice_ns):
            self._process_inline()
        self._inline_counted(fut.done())

    def _process_inline(self) -> None:
        """_process from the awaiting call; what it raises goes to the loop, as _poll_tick's."""
        try:
            if self._process(poll=True):
                self._poll_last = time.monotonic()
                self._polled += 1
        except Exception as e:  # noqa: BLE001 (another event's trouble is not this call's)
            self._loop.call_exception_handler({"message": "afabric: inline look", "exception": e})

    def _inline_counted(self, found: bool) -> None:
        if found:
            self._inline_left -= 1
        else:
            self._inline_left = _INLINE_RUN  # this await suspends: the loop runs

    def _alone(
        self, verb: str, code: int, mr: MemoryRegion, peer: int,
        mr_id: int, rid: int, length: int, src: int, dst: int, imm: int,
    ) -> Awaitable[None] | None:  # fmt: skip
        """A plain write or read (``code``) with nothing else in flight, where the loop polls:
        the shim submits it and looks for its completion in one call (afs_submit_take, up to
        _TAKE_MAX_NS), and one found there is consumed there: no future, no drain (None).
        Otherwise its future, after the inline look's accounting (_inline_ok, inlined here:
        this is the awaited write's path, docs/internals/architecture.md). The one in
        _INLINE_RUN that must let the loop run is looked for all the same; found, it yields
        once (a bare loop iteration) instead of waiting on a future, the poll tick and a
        drain (that wait was the p90 and p99 of an awaited write)."""
        if not self._polling:
            self._start_poll()
        op, took = self._n.take(verb, code, mr_id, rid, length, src, dst, imm, self._take_ns)
        if took == _TAKEN:
            self._poll_last = _monotonic()
            self._polled += 1
            self._inline_left -= 1
            if self._inline_left > 0:
                return None
            self._inline_left = _INLINE_RUN
            return self._yield_apart()  # done; other tasks run before the caller's next line
        fut: asyncio.Future[None] = self._loop.create_future()
        self._ops[op] = (fut, verb, peer, (mr,), verb)
        if took == _native.TAKE_OTHER:
            self._process_inline()
            self._inline_counted(fut.done())
        else:
            self._inline_left = _INLINE_RUN  # this await suspends: the loop runs
        return fut

    def _start_poll(self) -> None:
        self._polling = True
        self._poll_last = time.monotonic()
        self._loop.call_soon(_on_poll, self._wref)

    def _poll_tick(self) -> None:
        """One look at the ring from the loop: a callback that schedules itself again until
        spin_us passed since the last completion (or submission that started it), or many
        operations are in flight (a busy loop drains in batches when the fd says so). The
        last look is a plain drain, which asks the worker to signal the fd again: also when
        this one raised, so that the fd never stays unasked for. With tasks ready to run
        (_resuming: resumed by a drain, or in _alone's yield) it only looks: the loop runs so
        that they do, not to wait a slice ahead of them."""
        again = False
        try:
            if self._closed:
                return
            look = 0 if self._resuming else self._poll_slice_ns
            if self._n.pending_wait(look) and self._process(poll=True):
                self._poll_last = time.monotonic()
                self._polled += 1
            again = (
                not self._closed
                and time.monotonic() - self._poll_last < self._poll_window
                and len(self._ops) <= _POLL_MAX_IN_FLIGHT
            )
        finally:
            if again:
                self._loop.call_soon(_on_poll, self._wref)
            else:
                self._polling = False
                if self._process():
                    self._polled += 1

    def _process(self, poll: bool = False) -> bool:
        """Drain the ring and resolve futures (on the loop's thread): the fd's reader
        callback, and _poll_tick's look. Returns whether there was anything."""
        if self._closed:
            return False
        plain: list[int] | None = [] if self._first_posts is None else None
        events = self._n.drain(self._recv_room, plain, poll)
        if plain:
            self._succeeded(plain)
        for ev in events:
            if ev.kind == _native.C_DONE:
                self._done(ev)
            elif ev.kind == _native.C_WATCH:
                w = self._watchers.get(ev.id)
                if w is not None:
                    w._observed(ev.watch_old, ev.watch_new)
            elif ev.kind == _native.C_RELEASE:
                self._held.pop(ev.id, None)
            elif ev.kind == _native.C_PEER:
                self._peer_hub.publish(ev.payload or b"", ev.status != 0, ev.peer_pid, ev.peer_flags)
            elif ev.kind == _native.C_HELLO:
                self._learn(ev.payload or b"")
            elif ev.kind == _native.C_RECV:
                self._deliver(ev.payload or b"", ev.slot, ev.id)
            elif ev.kind == _native.C_STUCK:
                self._on_stuck(ev)
                return True
            elif ev.kind == _native.C_NOTICE and ev.id == _native.NOTICE_IMMS_DROPPED:
                self.log.warning(
                    "%d immediate(s) of new values dropped so far: the counter table holds "
                    "max_imm_values=%d distinct values (expect them before they arrive, or "
                    "raise the limit)", ev.total, self._max_imm_values,
                )  # fmt: skip
        self._resume(len(plain or ()) + len(events))
        return bool(plain or events)

    def _resume(self, resolved: int) -> None:
        """After a drain: with several resolved, their tasks run next and _resumed after them
        (the loop runs its callbacks in order); until then no submission is alone, where a
        look holding the loop for a round trip would cost more than a future (_resume_apart).
        64 lanes of 8 B writes on the GPU machine, loop CPU per write, medians of six runs
        (docs/guide/progress.md): shm 5.7 -> 4.4 µs once its resumed
        writes no longer went alone (12-14% of them had); cma 4.0 -> 4.6, so cma keeps them."""
        if resolved > 1 and self._resume_apart and not self._resuming:
            self._resuming = True
            self._loop.call_soon(self._resumed)

    async def _yield_apart(self) -> None:
        """_alone's yield: one loop iteration, in which the tasks that run are not alone
        (they go in flight together; each one's look would hold the others for a round trip:
        64 lanes of cma writes went one at a time, 59,661 of 60,000 alone)."""
        self._resuming = True
        try:
            await asyncio.sleep(0)
        finally:
            self._resuming = False

    def _resumed(self) -> None:
        self._resuming = False

    def _peer_closed_here(self, blob: bytes) -> None:
        """An engine of this process that this one resolved closed (_tell_closed_in_process)."""
        if not self._closed and self._peer_hub.is_known_up(blob):
            self._peer_hub.publish(blob, True, os.getpid(), PEER_CLOSED)

    def _on_stuck(self, ev: _native.Event) -> None:
        """The worker is stuck for good (shim/peers.c): nothing in flight will complete.
        Fail it all with EngineStuck and close (the native close does not wait for the
        worker; what it may still touch stays allocated and pinned, as close() does)."""
        self._stuck = self._n.error(ev.status, f"engine {self.name}", ev.text)
        self.log.error("%s", self._stuck)
        with contextlib.suppress(errors.AfabricError):  # the worker did not stop: known
            self._shut(self._stuck)

    def _succeeded(self, ids: list[int]) -> None:
        """_done for a batch of plain successes (no text, nothing held back)."""
        pop = self._ops.pop
        for op_id in ids:
            op = pop(op_id, None)
            if op is None:
                continue
            fut = op[0]  # (future, verb, peer, refs, kind): afabric/_ops.py
            if not fut.done():
                fut.set_result(None)
            elif op[4] == "expect" and fut.cancelled():
                self._n.imm_return(*op[3])  # withdrawn, yet it consumed: give them back

    def _done(self, ev: _native.Event) -> None:
        op = self._ops.pop(ev.id, None)
        if op is None:
            return
        fut, _, _, refs, kind = op
        if ev.release_later:
            self._held[ev.id] = refs
        if self._first_posts is not None and ev.first_post_ns:
            self._first_posts.append((ev.id, ev.first_post_ns))
        if fut.done():
            if kind == "expect" and ev.status == 0 and fut.cancelled():
                self._n.imm_return(*refs)  # withdrawn, yet it consumed: give them back
            return
        if ev.status == 0:
            fut.set_result(None)
        else:
            fut.set_exception(self._n.error(ev.status, op_label(op), ev.text))

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<afabric.Engine {self.name} provider={self.provider} ({state})>"
