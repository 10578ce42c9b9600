"""Running a benchmark's coroutine on the event loop it was asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from . import interrupt

_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T], loop: str) -> _T:
    """``asyncio.run`` on asyncio's loop or uvloop's (imported only when asked for). Under
    :func:`afabric.bench.interrupt.handled`, a stopping signal cancels ``coro`` and this
    raises KeyboardInterrupt once it has unwound."""

    async def main() -> _T:
        task = asyncio.current_task()
        assert task is not None
        with interrupt.cancels(task):
            return await coro

    try:
        if loop == "uvloop":
            import uvloop

            return uvloop.run(main())
        return asyncio.run(main())
    except asyncio.CancelledError:
        if interrupt.received() is None:
            raise
        raise KeyboardInterrupt from None
