"""Running a benchmark's coroutine on the event loop it was asked for."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T], loop: str) -> _T:
    """``asyncio.run`` on asyncio's loop or uvloop's (imported only when asked for)."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(coro)
    return asyncio.run(coro)
