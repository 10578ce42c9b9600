"""Staging memory: one registered buffer handed out in slices, first fit. A slice is
taken when a task is prepared and given back when its writes complete; a task waits while
no slice fits, which is the watermark bounding the temporary memory in flight."""

from __future__ import annotations

import asyncio

from ..errors import InvalidArgument

ALIGN = 64


class Arena:
    def __init__(self, size: int) -> None:
        self.size = size
        self._free: list[tuple[int, int]] = [(0, size)]  # sorted (start, length)
        self._cond = asyncio.Condition()
        self.in_use = 0
        self.peak = 0

    def _take(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self._free):
            if length >= n:
                if length == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, length - n)
                self.in_use += n
                self.peak = max(self.peak, self.in_use)
                return start
        return None

    async def alloc(self, nbytes: int) -> tuple[int, int]:
        """``(offset, size)`` of a slice of at least ``nbytes``; waits for space."""
        n = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        if n > self.size:
            raise InvalidArgument(f"a {nbytes}-byte slice does not fit the {self.size}-byte staging buffer")
        async with self._cond:
            while (off := self._take(n)) is None:
                await self._cond.wait()
        return off, n

    async def free(self, off: int, n: int) -> None:
        async with self._cond:
            self.in_use -= n
            self._free.append((off, n))
            self._free.sort()
            merged: list[tuple[int, int]] = []
            for s, ln in self._free:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + ln)
                else:
                    merged.append((s, ln))
            self._free = merged
            self._cond.notify_all()
