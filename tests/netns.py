"""A two-rail test bed for multi-NIC tests: two network namespaces joined by two veth pairs.

::

    ns A (afa-<pid>-<n>)                       ns B (afb-<pid>-<n>)
    r0a 192.0.2.1/24     <-- rail 0 -->        r0b 192.0.2.2/24
    r1a 198.51.100.1/24  <-- rail 1 -->        r1b 198.51.100.2/24

Documentation address ranges only (RFC 5737). Usage::

    require()                                    # skip (or fail in CI) without netns support
    with TwoRails() as tb:
        tb.slow_rail(1, delay_ms=5, rate="50mbit")   # rail 1 much slower than rail 0
        target = tb.peer("b", target_fn, "r0b", ...)  # runs in ns B
        initiator = tb.peer("a", initiator_fn, "r0a", ...)
        tx, rx = tb.bytes(0)                      # counters of ns A's interface of rail 0

The test process itself never enters a namespace: both ends are :class:`tests.procs.Peer`
processes, and a child enters its namespace first thing (:func:`enter`, through
:func:`in_netns`). Namespaces are deleted on exit, even on errors; namespaces left by
crashed runs (named with our prefixes and the pid of a dead process) are removed when
the next bed is built.

This machine's kernel has no netem (``CONFIG_NET_SCH_NETEM`` unset, only tbf/htb/fifo):
:meth:`TwoRails.slow_rail` then shapes the rail with a token bucket instead, see there.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import json
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

from .procs import Ctl, Peer

NETNS_DIR = Path("/var/run/netns")
REQUIRE_ENV = "AFABRIC_REQUIRE_NETNS"
_OURS = re.compile(r"^(?:afa|afb|afp)-(\d+)(?:-\d+)?$")
_SEQ = itertools.count()
_CMD_TIMEOUT = 20.0

# tbf stands in for netem when the kernel lacks it (see TwoRails.slow_rail)
TBF_FALLBACK_RATE = "50mbit"

_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_SLAVE = 1 << 19
_MNT_DETACH = 2

Side = Literal["a", "b"]


@dataclass(frozen=True)
class Rail:
    """One veth pair: ``iface_a`` (in ns A, address ``addr_a``) <-> ``iface_b`` (in ns B)."""

    index: int
    iface_a: str
    iface_b: str
    addr_a: str
    addr_b: str
    prefix: int = 24


RAILS = (
    Rail(0, "r0a", "r0b", "192.0.2.1", "192.0.2.2"),
    Rail(1, "r1a", "r1b", "198.51.100.1", "198.51.100.2"),
)


class NetnsError(RuntimeError):
    """An `ip`/`tc` command failed (the message has the command and its stderr)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=False)
    if check and p.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _list_netns() -> list[str]:
    p = _run("ip", "-j", "netns", "list", check=False)
    if p.returncode != 0 or not p.stdout.strip():
        return []
    return [str(e["name"]) for e in json.loads(p.stdout)]


def _delete_netns(name: str) -> None:
    _run("ip", "netns", "delete", name, check=False)


def cleanup_stale() -> list[str]:
    """Delete namespaces of earlier runs whose process is gone (our name prefixes only).
    Returns the names deleted."""
    gone = []
    for name in _list_netns():
        m = _OURS.match(name)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            _delete_netns(name)
            gone.append(name)
    return gone


# ---- availability ----


@dataclass(frozen=True)
class _Caps:
    ok: bool
    reason: str
    netem: bool


def _probe_in(name: str) -> _Caps:
    p = _run("ip", "netns", "add", name, check=False)
    if p.returncode != 0:
        return _Caps(False, f"cannot create a network namespace: {p.stderr.strip()}", False)
    p = _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1", check=False)
    if p.returncode != 0:
        return _Caps(False, f"cannot create a veth pair: {p.stderr.strip()}", False)
    p = _run("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "netem", "delay", "1ms", check=False)
    if p.returncode == 0:
        return _Caps(True, "", True)
    tbf = ("tbf", "rate", "1mbit", "burst", "65536", "latency", "100ms")
    p = _run("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", *tbf, check=False)
    if p.returncode != 0:
        return _Caps(False, f"neither netem nor tbf qdiscs work: {p.stderr.strip()}", False)
    return _Caps(True, "", False)


@functools.cache
def _probe() -> _Caps:
    if os.geteuid() != 0:
        return _Caps(False, "network namespaces need root", False)
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return _Caps(False, f"{', '.join(missing)} (iproute2) not installed", False)
    with contextlib.suppress(Exception):
        cleanup_stale()
    name = f"afp-{os.getpid()}-{next(_SEQ)}"
    try:
        return _probe_in(name)
    except (OSError, subprocess.SubprocessError) as e:
        return _Caps(False, f"probing network namespaces failed: {e}", False)
    finally:
        _delete_netns(name)


def available() -> tuple[bool, str]:
    """Whether this process can build a :class:`TwoRails` (root, iproute2, netns, veth and
    a traffic-shaping qdisc); probed once. The reason says what is missing."""
    caps = _probe()
    return caps.ok, caps.reason


def netem_available() -> bool:
    """Whether the kernel has netem (real delay/jitter emulation); tbf is used otherwise."""
    return _probe().netem


def require() -> None:
    """In a test: skip when :func:`available` says no, or fail when $AFABRIC_REQUIRE_NETNS=1
    (CI, where the bed must exist)."""
    import pytest

    ok, reason = available()
    if ok:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but the two-rail test bed is unavailable: {reason}")
    pytest.skip(f"two-rail test bed unavailable: {reason}")


# ---- entering a namespace (in a child process) ----


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def enter(ns_name: str, *, remount_sys: bool | None = None) -> bool:
    """Move the calling process into network namespace `ns_name` (``setns(2)``, which Python
    3.11's os lacks). Call it first thing in a child, before any Python thread is started:
    a thread keeps the namespace it was created in (threads of native libraries started at
    import, e.g. OpenBLAS's, stay behind: they do no networking).

    `remount_sys`: also give the process a private mount namespace with the new
    namespace's /sys (as ``ip netns exec`` does), so /sys/class/net shows its interfaces.
    That needs a single-threaded process (``unshare(CLONE_NEWNS)``): None (default) does
    it when possible, True requires it, False skips it. Returns whether /sys was remounted.
    """
    if threading.active_count() != 1:
        raise RuntimeError("enter() must run before the process starts Python threads")
    libc = _libc()
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    fd = os.open(NETNS_DIR / ns_name, os.O_RDONLY | os.O_CLOEXEC)
    try:
        _check(libc.setns(fd, _CLONE_NEWNET), f"setns({NETNS_DIR / ns_name}, CLONE_NEWNET)")
        want = os.fstat(fd).st_ino
    finally:
        os.close(fd)
    if os.stat("/proc/thread-self/ns/net").st_ino != want:
        raise RuntimeError(f"setns did not move this process into {ns_name}")
    if remount_sys is False or (remount_sys is None and _os_threads() != 1):
        return False
    libc.unshare.argtypes = [ctypes.c_int]
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_void_p]
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS) (needs a single-threaded process)")
    # never let the /sys swap below propagate back to the host's mounts
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    _check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    _check(libc.mount(ns_name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")
    return True


async def in_netns(ctl: Ctl, ns_name: str, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    """Peer entry point: enter `ns_name`, then run ``fn(ctl, *args)`` there.
    ``Peer(in_netns, ns_name, fn, *args)``; `fn` must be module-level (pickled under spawn)."""
    enter(ns_name)
    return await fn(ctl, *args)


async def interfaces(ctl: Ctl) -> dict[str, list[str]]:
    """A Peer function (``TwoRails.peer(side, interfaces)``): the interfaces this process
    sees through netlink (``socket.if_nameindex``) and through /sys/class/net."""
    import socket

    return {
        "netlink": sorted(name for _, name in socket.if_nameindex()),
        "sys": sorted(os.listdir("/sys/class/net")),
    }


def netns_peer(ns_name: str, fn: Callable[..., Awaitable[Any]], *args: Any, loop: str = "asyncio") -> Peer:
    """Start ``fn(ctl, *args)`` in a new process inside network namespace `ns_name`."""
    return Peer(in_netns, ns_name, fn, *args, loop=loop)


# ---- the bed ----


class TwoRails:
    """Two namespaces (``ns_a``, ``ns_b``) joined by two veth rails (see the module doc).

    A context manager; `build()`/`close()` do the same by hand (close is idempotent and
    also removes whatever a half-finished build made)."""

    rails: tuple[Rail, ...] = RAILS

    def __init__(self, *, ipv6: bool = False) -> None:
        tag = f"{os.getpid()}-{next(_SEQ)}"
        self.ns_a = f"afa-{tag}"
        self.ns_b = f"afb-{tag}"
        self.ipv6 = ipv6
        """IPv6 stays off by default: no link-local addresses (libfabric would list each
        interface once per address family) and no neighbour-discovery chatter on the
        byte counters."""
        self.shaping: dict[int, str] = {}
        """The qdisc applied per slowed rail, as given to tc (e.g. "netem delay 5ms ...")."""

    # lifetime

    def __enter__(self) -> TwoRails:
        self.build()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def build(self) -> TwoRails:
        ok, reason = available()
        if not ok:
            raise NetnsError(f"two-rail test bed unavailable: {reason}")
        cleanup_stale()
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        a, b = self.ns_a, self.ns_b
        _run("ip", "netns", "add", a)
        _run("ip", "netns", "add", b)
        for ns in (a, b):
            if not self.ipv6:
                # `ip netns exec` gives sysctl the namespace's /proc/sys/net
                off = ("net.ipv6.conf.all.disable_ipv6=1", "net.ipv6.conf.default.disable_ipv6=1")
                _run("ip", "netns", "exec", ns, "sysctl", "-qw", *off)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
        for r in self.rails:
            veth = ("type", "veth", "peer", "name", r.iface_b, "netns", b)
            _run("ip", "-n", a, "link", "add", r.iface_a, *veth)
            _run("ip", "-n", a, "addr", "add", f"{r.addr_a}/{r.prefix}", "dev", r.iface_a)
            _run("ip", "-n", b, "addr", "add", f"{r.addr_b}/{r.prefix}", "dev", r.iface_b)
            _run("ip", "-n", a, "link", "set", r.iface_a, "up")
            _run("ip", "-n", b, "link", "set", r.iface_b, "up")
        self._wait_up()

    def _wait_up(self, timeout: float = 10.0) -> None:
        """Wait for every rail interface to be operationally up: the kernel reports a new
        veth's carrier up to a second late (linkwatch), and until then libfabric's tcp
        provider skips the interface (fi_getinfo lists only lo)."""
        deadline = time.monotonic() + timeout
        while True:
            down = []
            for side in ("a", "b"):
                p = _run("ip", "-n", self.ns(side), "-j", "link", "show")
                state = {str(e["ifname"]): str(e.get("operstate", "")) for e in json.loads(p.stdout)}
                down += [i for i in (self.iface(r.index, side) for r in self.rails) if state.get(i) != "UP"]
            if not down:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"rail interfaces still not up after {timeout} s: {down}")
            time.sleep(0.02)

    def close(self) -> None:
        for ns in (self.ns_a, self.ns_b):
            _delete_netns(ns)  # takes the veth pairs with it

    # helpers

    def ns(self, side: Side) -> str:
        return self.ns_a if side == "a" else self.ns_b

    def iface(self, rail: int, side: Side = "a") -> str:
        r = self.rails[rail]
        return r.iface_a if side == "a" else r.iface_b

    def addr(self, rail: int, side: Side = "a") -> str:
        r = self.rails[rail]
        return r.addr_a if side == "a" else r.addr_b

    def peer(self, side: Side, fn: Callable[..., Awaitable[Any]], *args: Any, loop: str = "asyncio") -> Peer:
        """Start ``fn(ctl, *args)`` as a Peer process inside this bed's namespace `side`."""
        return netns_peer(self.ns(side), fn, *args, loop=loop)

    def slow_rail(self, rail: int, delay_ms: float, jitter_ms: float = 0.0, rate: str | None = None) -> str:
        """Make `rail` slow, on both of its ends (egress of each veth), and return the qdisc.

        With netem: ``netem delay <delay_ms>ms [<jitter_ms>ms] [rate <rate>]``.

        Without netem (this machine's kernel), delay cannot be added to an otherwise idle
        link; the rail is rate-limited with ``tbf rate <rate or TBF_FALLBACK_RATE>`` and a
        queue of ``delay_ms + jitter_ms`` (at least 20 ms): a bulk transfer fills that queue,
        so it sees about that much extra latency and the rail's bandwidth drops to `rate`,
        which is what reorders traffic striped across rails. :attr:`shaping` records which.
        """
        if delay_ms < 0 or jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if netem_available():
            spec = ["netem", "delay", f"{delay_ms}ms"]
            if jitter_ms:
                spec.append(f"{jitter_ms}ms")
            if rate:
                spec += ["rate", rate]
        else:
            latency = max(delay_ms + jitter_ms, 20.0)
            spec = ["tbf", "rate", rate or TBF_FALLBACK_RATE, "burst", "65536", "latency", f"{latency}ms"]
        for side in ("a", "b"):
            _run("tc", "-n", self.ns(side), "qdisc", "replace", "dev", self.iface(rail, side), "root", *spec)
        self.shaping[rail] = " ".join(spec)
        return self.shaping[rail]

    def fast_rail(self, rail: int) -> None:
        """Undo :meth:`slow_rail`."""
        for side in ("a", "b"):
            dev = self.iface(rail, side)
            _run("tc", "-n", self.ns(side), "qdisc", "del", "dev", dev, "root", check=False)
        self.shaping.pop(rail, None)

    def counters(self, rail: int, side: Side = "a") -> tuple[int, int]:
        """(tx bytes, rx bytes) of `rail`'s interface in namespace `side`."""
        p = _run("ip", "-n", self.ns(side), "-s", "-j", "link", "show", "dev", self.iface(rail, side))
        stats = json.loads(p.stdout)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def bytes(self, rail: int) -> tuple[int, int]:
        """(tx, rx) byte counters of ns A's interface of `rail`."""
        return self.counters(rail, "a")


@contextlib.contextmanager
def two_rails(**kw: Any) -> Iterator[TwoRails]:
    """``with two_rails() as tb:`` -- a TwoRails, skipping the test when unavailable."""
    require()
    with TwoRails(**kw) as tb:
        yield tb
