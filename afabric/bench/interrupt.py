"""How the ``afabric`` command, and its benchmarks' child processes, stop on a signal.

SIGINT (Ctrl-C), SIGTERM (``kill``, ``timeout``) and SIGHUP (a closed terminal) all stop a
run the same way: the first one cancels the coroutine :func:`afabric.bench.loops.run` is
running (as asyncio's own Ctrl-C handling does), so every ``async with Engine`` closes and
removes its /dev/shm files and child processes are told to stop; outside a loop, or at a
second signal, it raises KeyboardInterrupt where the program is. The command then prints
one line and exits with 128 + the signal's number.

Only the command installs these (:func:`handled`, around one command): a library must not
take an application's signals. An application's engines are closed at exit (atexit) and
what a killed process leaves behind is reclaimed by the next engine on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["SIGNALS", "cancels", "exit_status", "handled", "received"]

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_received: int | None = None
_main: tuple[asyncio.AbstractEventLoop, asyncio.Task[Any]] | None = None


def received() -> int | None:
    """The first stopping signal received while :func:`handled` was in force, else None."""
    return _received


def exit_status(signum: int) -> int:
    """The conventional exit status of a program stopped by ``signum``: 128 + its number."""
    return 128 + signum


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _received
    first = _received is None
    if first:
        _received = signum
    target = _main
    if first and target is not None and not target[1].done():
        loop, task = target
        task.cancel()
        with contextlib.suppress(RuntimeError):  # wake the loop's selector (its thread is this one)
            loop.call_soon_threadsafe(lambda: None)
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """Within this block, SIGINT, SIGTERM and SIGHUP stop the run cleanly (see the module);
    the previous handlers come back afterwards. Does nothing off the main thread."""
    global _received
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received = None
    previous = {sig: signal.signal(sig, _on_signal) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def cancels(task: asyncio.Task[Any]) -> Iterator[None]:
    """While this block runs, a stopping signal cancels ``task`` (the main coroutine's)."""
    global _main
    before = _main
    _main = (task.get_loop(), task)
    try:
        yield
    finally:
        _main = before
