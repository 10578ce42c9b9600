"""Blocking torch calls (collectives, tensor preparation) run on a daemon thread and are
awaited from the loop, so the loop keeps posting writes meanwhile, and a collective stuck
on a dead peer can be abandoned after a deadline (the thread is left to gloo's timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


class Worker:
    """One daemon thread running submitted calls in order."""

    def __init__(self, name: str) -> None:
        self._q: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, fut = item
            loop = fut.get_loop()
            try:
                result = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
                _settle(loop, fut, None, e)
            else:
                _settle(loop, fut, result, None)

    async def call(self, fn: Callable[[], _T]) -> _T:
        fut: asyncio.Future[_T] = asyncio.get_running_loop().create_future()
        self._q.put((fn, fut))
        return await fut

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread once its current call returns (waiting up to ``timeout``: a
        thread still inside torch when the interpreter exits would abort the process)."""
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)


def _settle(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any], result: Any, exc: BaseException | None
) -> None:
    def done() -> None:
        if fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody awaits any more
        loop.call_soon_threadsafe(done)
