"""Real peer processes for tests: each runs an async function in its own process with its
own event loop and engine, and talks to the test over a pipe (addresses, descriptors,
"go"/"done" messages). Nothing here touches the transport: the engines do."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import select
import signal
import time
import traceback
from collections.abc import Awaitable, Callable
from multiprocessing.connection import Connection
from typing import Any

_CTX = mp.get_context("spawn")


class Ctl:
    """The child's end of the control pipe, usable from async code."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def put(self, obj: Any) -> None:
        self.conn.send(obj)

    async def get(self, timeout: float = 60.0) -> Any:
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, self.conn.poll, timeout)
        if not ready:
            raise TimeoutError("no control message from the test")
        return self.conn.recv()


def _thread_states(pid: int) -> list[str]:
    """The scheduler state letter of every thread of pid (threads that exit meanwhile are
    left out)."""
    states = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return states


async def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP pid and return once every thread of it has stopped. kill() returns before they
    reach the stop: on the loaded 2-core machine the state read right after was still R in 7
    of 10 runs, and one stopped tcp target still acknowledged four 4 KiB writes 0.5 ms after
    kill() had returned (test_stopped_peer_times_out_then_recovers failed so in a clean-clone
    run)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while not all(s in ("T", "t") for s in _thread_states(pid)):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} did not stop within {timeout} s: {_thread_states(pid)}")
        await asyncio.sleep(0.001)


def _new_loop(kind: str) -> asyncio.AbstractEventLoop:
    if kind == "uvloop":
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run_child(
    fn: Callable[..., Awaitable[Any]], conn: Connection, loop_kind: str, args: tuple[Any, ...]
) -> None:
    """A Peer process's body: run ``fn(ctl, *args)`` on a new loop and report its outcome."""
    ctl = Ctl(conn)
    loop = _new_loop(loop_kind)
    try:
        result = loop.run_until_complete(fn(ctl, *args))
        conn.send(("__result__", result))
    except BaseException as e:  # noqa: BLE001 - report everything to the test
        conn.send(("__error__", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        loop.close()
        conn.close()


Entry = Callable[[Callable[..., Awaitable[Any]], Connection, str, tuple[Any, ...]], None]
"""What a Peer process runs, given (fn, conn, loop kind, args): :func:`run_child`, or a
picklable callable that prepares the process (tests/hosts.py: another PID namespace) and
then calls it."""


def kill_through_pidfd(fd: int, pid: int) -> float:
    """SIGKILL `pid` (whose pidfd is `fd`, closed here) and return when it was gone: when
    the pidfd turned readable (time.monotonic())."""
    try:
        os.kill(pid, signal.SIGKILL)
        waiter = select.poll()  # (not select(): the fd may be above FD_SETSIZE)
        waiter.register(fd, select.POLLIN)
        waiter.poll(10_000)
        return time.monotonic()
    finally:
        os.close(fd)


class Peer:
    """The test's handle on a child process."""

    def __init__(
        self, fn: Callable[..., Awaitable[Any]], *args: Any, loop: str = "asyncio", entry: Entry = run_child
    ) -> None:
        self.conn, child_conn = _CTX.Pipe()
        self.proc = _CTX.Process(target=entry, args=(fn, child_conn, loop, args), daemon=True)
        self.proc.start()
        child_conn.close()
        self._result: Any = None
        self._done = False

    def put(self, obj: Any) -> None:
        self.conn.send(obj)

    async def get(self, timeout: float = 60.0) -> Any:
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, self.conn.poll, timeout)
        if not ready:
            raise TimeoutError(f"peer {self.proc.pid} sent nothing in {timeout} s")
        msg = self.conn.recv()
        if isinstance(msg, tuple) and msg and msg[0] == "__error__":
            self._done = True
            raise AssertionError(f"peer failed:\n{msg[1]}")
        if isinstance(msg, tuple) and msg and msg[0] == "__result__":
            self._done = True
            self._result = msg[1]
            raise AssertionError(f"peer finished early with {msg[1]!r}")
        return msg

    async def result(self, timeout: float = 60.0) -> Any:
        """Wait for the child's function to return; raise if it failed."""
        loop = asyncio.get_running_loop()
        ready = await loop.run_in_executor(None, self.conn.poll, timeout)
        if not ready:
            raise TimeoutError(f"peer {self.proc.pid} did not finish in {timeout} s")
        msg = self.conn.recv()
        if msg[0] == "__error__":
            raise AssertionError(f"peer failed:\n{msg[1]}")
        if msg[0] != "__result__":
            raise AssertionError(f"unexpected message from peer: {msg!r}")
        await loop.run_in_executor(None, self.proc.join, timeout)
        return msg[1]

    def kill(self) -> float:
        """SIGKILL the child and reap it. Returns when (time.monotonic()) its process was
        gone: its pidfd turned readable, the kernel's moment that the shim's watch
        (shim/peers.c) waits for too. The time from the signal to it is the kernel's."""
        gone = time.monotonic()
        pid = self.proc.pid
        if self.proc.is_alive() and pid is not None:
            # ours and not reaped yet: the pid cannot be reused
            gone = kill_through_pidfd(os.pidfd_open(pid), pid)
        self.proc.join(10)
        return gone

    def close(self) -> None:
        if self.proc.is_alive():
            self.kill()
        self.conn.close()
