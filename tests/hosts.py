"""A two-host test bed on one machine: host A and host B, joined by one veth pair.

::

    host A: ns afa-<pid>-<n>, the test's PID namespace      r0a 192.0.2.1/24
        <-- veth -->
    host B: ns afb-<pid>-<n>, its own PID namespace + /proc r0b 192.0.2.2/24

afabric tells hosts apart by a hash of the boot id and the PID namespace (shim/procfs.c,
afs_proc_self; :attr:`afabric.Address.host`): A's processes share the test's PID namespace,
so they are one host; B's live in a PID namespace of their own, so they are another host,
reachable only over the network (tcp), not by cross-memory attach (cma). Usage::

    require()                                  # skip (or fail in CI) without the bed
    with TwoHosts() as tb:
        target = tb.peer("b", target_fn, ...)  # pid 2, 3, ... in B's PID namespace
        a1, a2 = tb.peer("a", fn, ...), tb.peer("a", fn, ...)
        tb.host_addr("a"), tb.host_addr("b")   # "192.0.2.1", "192.0.2.2"

Host B's PID namespace is held by its init: ``setpriv --pdeathsig KILL ip netns exec <B>
unshare --pid --fork --mount-proc --kill-child sleep infinity``, so it is in B's network
namespace, has B's /sys and a /proc of its PID namespace, and dies with the test process
(each link of that chain has a parent-death signal). A B peer's process (a spawned
:class:`tests.procs.Peer`) joins B's PID namespace and forks; the fork joins B's network and
mount namespaces and runs the peer's function, and is SIGKILLed if that process dies. When
B's init dies the kernel kills every process of the namespace; :meth:`TwoHosts.close` kills
it and waits until all of them are reaped.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from . import netns
from .netns import RAILS, NetnsError, Side, TwoRails
from .procs import Ctl, Peer, kill_through_pidfd, run_child

_CLONE_NEWPID = 0x20000000
_PR_SET_PDEATHSIG = 1
_START_TIMEOUT = 20.0
_STOP_TIMEOUT = 30.0


# ---- availability ----


@functools.cache
def _probe() -> tuple[bool, str]:
    ok, reason = netns.available()
    if not ok:
        return ok, reason
    missing = [tool for tool in ("unshare", "setpriv") if shutil.which(tool) is None]
    if missing:
        return False, f"{', '.join(missing)} (util-linux) not installed"
    try:
        p = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"],
            capture_output=True,
            text=True,
            timeout=_START_TIMEOUT,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"probing PID namespaces failed: {e}"
    if p.returncode != 0:
        return False, f"cannot create a PID namespace with its own /proc: {p.stderr.strip()}"
    return True, ""


def available() -> tuple[bool, str]:
    """Whether this process can build a :class:`TwoHosts` (what :func:`tests.netns.available`
    needs, plus PID namespaces and util-linux's unshare and setpriv); probed once."""
    return _probe()


def require() -> None:
    """In a test: skip when :func:`available` says no, or fail when $AFABRIC_REQUIRE_NETNS=1."""
    import pytest

    ok, reason = available()
    if ok:
        return
    if os.environ.get(netns.REQUIRE_ENV) == "1":
        pytest.fail(f"{netns.REQUIRE_ENV}=1 but the two-host test bed is unavailable: {reason}")
    pytest.skip(f"two-host test bed unavailable: {reason}")


# ---- a process of host B ----


def _setns(libc: ctypes.CDLL, fd: int, kind: int, what: str) -> None:
    netns._check(libc.setns(fd, kind), f"setns({what})")


def _die_with_parent(libc: ctypes.CDLL, parent_alive: int) -> None:
    """SIGKILL this process when its parent dies. `parent_alive` is the read end of a pipe
    whose write end only the parent holds: at EOF the parent died before the prctl did."""
    netns._check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    waiter = select.poll()
    waiter.register(parent_alive, select.POLLIN)
    if waiter.poll(0):
        os._exit(1)


def _in_host_b(ns_fds: dict[str, int], parent_alive: int) -> None:
    """In the forked process (single-threaded, as joining a mount namespace needs): die with
    the parent, join B's network and mount namespaces (B's /sys and /proc), check /proc."""
    libc = netns._libc()
    libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    _die_with_parent(libc, parent_alive)
    os.close(parent_alive)
    _setns(libc, ns_fds["net"], netns._CLONE_NEWNET, "host B's network namespace")
    _setns(libc, ns_fds["mnt"], netns._CLONE_NEWNS, "host B's mount namespace")
    for fd in ns_fds.values():
        os.close(fd)
    os.chdir("/")
    if os.readlink("/proc/self") != str(os.getpid()):
        raise RuntimeError(
            f"/proc is not host B's: /proc/self is {os.readlink('/proc/self')}, pid {os.getpid()}"
        )


def _report_failure(conn: Connection, where: str) -> None:
    with contextlib.suppress(OSError):
        conn.send(("__error__", f"{where}:\n{traceback.format_exc()}"))


def host_b_entry(
    init_pid: int,
    pidns: int,
    fn: Callable[..., Awaitable[Any]],
    conn: Connection,
    loop_kind: str,
    args: tuple[Any, ...],
) -> None:
    """A B peer's process (a :data:`tests.procs.Entry`): join the PID namespace of host B's
    init (`init_pid`, whose namespace has inode `pidns`), fork, run the peer in the fork and
    wait for it. Only that process talks to the test."""
    try:
        ns_fds = {
            k: os.open(f"/proc/{init_pid}/ns/{k}", os.O_RDONLY | os.O_CLOEXEC) for k in ("pid", "net", "mnt")
        }
        if os.fstat(ns_fds["pid"]).st_ino != pidns:
            raise RuntimeError(f"process {init_pid} is no longer host B's init")
        libc = netns._libc()
        libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]
        _setns(libc, ns_fds["pid"], _CLONE_NEWPID, "host B's PID namespace")  # for children
        parent_alive, held = os.pipe()
        child = os.fork()
    except BaseException:
        _report_failure(conn, "joining host B")
        raise
    if child == 0:
        code = 1
        try:
            os.close(held)
            try:
                _in_host_b(ns_fds, parent_alive)
            except BaseException:
                _report_failure(conn, "entering host B")
                raise
            run_child(fn, conn, loop_kind, args)
            code = 0
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)  # never back into multiprocessing's bootstrap
    os.close(parent_alive)
    for fd in ns_fds.values():
        os.close(fd)
    conn.close()
    _, status = os.waitpid(child, 0)
    os.close(held)
    sys.exit(os.waitstatus_to_exitcode(status))


def children(pid: int) -> list[int]:
    """The child processes of `pid`'s main thread (a B peer's process is its parent's)."""
    with contextlib.suppress(OSError):
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


class HostBPeer(Peer):
    """A :class:`Peer` whose function runs in host B (see :func:`host_b_entry`). ``proc`` is
    the spawned process outside B; the peer itself is its only child."""

    def __init__(
        self, init_pid: int, pidns: int, fn: Callable[..., Awaitable[Any]], *args: Any, loop: str = "asyncio"
    ) -> None:
        super().__init__(fn, *args, loop=loop, entry=functools.partial(host_b_entry, init_pid, pidns))

    def kill(self) -> float:
        """SIGKILL the peer in B and reap it (its parent outside B does, then exits); returns
        when the peer was gone, as :meth:`Peer.kill`. Falls back to killing the parent, which
        takes the peer with it (parent-death signal), if there is no peer yet."""
        pid = self.proc.pid
        inner = children(pid) if pid is not None and self.proc.is_alive() else []
        if len(inner) != 1:
            return super().kill()
        try:
            fd = os.pidfd_open(inner[0])
        except ProcessLookupError:
            return super().kill()
        gone = kill_through_pidfd(fd, inner[0])
        self.proc.join(10)
        if self.proc.is_alive():
            super().kill()
        return gone


# ---- the bed ----


class TwoHosts(TwoRails):
    """Host A (namespace ``ns_a``) and host B (``ns_b`` and a PID namespace) joined by rail 0
    of :mod:`tests.netns`. A context manager like :class:`TwoRails` (build/close by hand too).
    Build it on the thread that outlives it (the test's): B's init gets its parent-death
    signal when the thread that started it ends."""

    rails = RAILS[:1]

    def __init__(self) -> None:
        super().__init__()
        self._init: subprocess.Popen[bytes] | None = None
        self.init_pid = 0
        """Host B's init (pid 1 in B), as this process sees it."""
        self.pidns_b = 0
        """The inode of host B's PID namespace."""

    def __enter__(self) -> TwoHosts:
        self.build()
        return self

    def _build(self) -> None:
        super()._build()
        argv = ["setpriv", "--pdeathsig", "KILL", "ip", "netns", "exec", self.ns_b]
        argv += ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", "sleep", "infinity"]
        self._init = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        self.init_pid, self.pidns_b = self._wait_init(self._init)

    def _wait_init(self, unshare: subprocess.Popen[bytes]) -> tuple[int, int]:
        """Host B's init once it runs `sleep` (so /proc is mounted): its pid and PID namespace."""
        mine = os.stat("/proc/self/ns/pid").st_ino
        deadline = time.monotonic() + _START_TIMEOUT
        while True:
            if unshare.poll() is not None:
                err = unshare.stderr.read().decode(errors="replace") if unshare.stderr else ""
                raise NetnsError(f"host B's init exited ({unshare.returncode}): {err.strip()}")
            for pid in children(unshare.pid):
                with contextlib.suppress(OSError):
                    ns = os.stat(f"/proc/{pid}/ns/pid").st_ino
                    if ns != mine and Path(f"/proc/{pid}/comm").read_text().strip() == "sleep":
                        return pid, ns
            if time.monotonic() > deadline:
                raise NetnsError(f"host B's init did not start within {_START_TIMEOUT} s")
            time.sleep(0.01)

    def close(self) -> None:
        """Kill host B's init (the kernel kills the rest of B) and wait until B is empty, then
        delete the namespaces."""
        init, self._init = self._init, None
        if init is not None:
            if init.poll() is None:
                if self.init_pid:
                    # unshare then reaps it, which the kernel lets happen only once every
                    # other process of B has exited (zap_pid_ns_processes)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(self.init_pid, signal.SIGKILL)
                else:
                    init.kill()  # (unshare passes it on to B's init: --kill-child)
            init.communicate(timeout=_STOP_TIMEOUT)
        super().close()

    def host_addr(self, side: Side) -> str:
        """The address of host `side`'s end of the veth pair (192.0.2.1 in A, 192.0.2.2 in B)."""
        return self.addr(0, side)

    def peer(self, side: Side, fn: Callable[..., Awaitable[Any]], *args: Any, loop: str = "asyncio") -> Peer:
        """Start ``fn(ctl, *args)`` as a Peer process on host `side`."""
        if side == "a":
            return super().peer("a", fn, *args, loop=loop)
        if self._init is None:
            raise NetnsError("the bed is not built")
        return HostBPeer(self.init_pid, self.pidns_b, fn, *args, loop=loop)


def host_facts() -> dict[str, Any]:
    """What the kernel tells the calling process about its host: pid, /proc/self, PID and
    network namespace inodes, boot id, interfaces."""
    import socket

    return {
        "pid": os.getpid(),
        "proc_self": os.readlink("/proc/self"),
        "pidns": os.stat("/proc/self/ns/pid").st_ino,
        "netns": os.stat("/proc/self/ns/net").st_ino,
        "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
    }


async def whoami(ctl: Ctl) -> dict[str, Any]:
    """A Peer function (``TwoHosts.peer(side, whoami)``): :func:`host_facts` of the peer."""
    return host_facts()


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    """``with two_hosts() as tb:`` -- a TwoHosts, skipping the test when unavailable."""
    require()
    with TwoHosts() as tb:
        yield tb
