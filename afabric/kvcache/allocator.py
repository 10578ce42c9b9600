"""Page allocation for a paged cache: free extents, contiguous runs preferred.

Contiguous pages mean fewer, larger writes (see :mod:`afabric.kvcache.layout`), so an
allocation takes the smallest free extent that holds it whole, and only when none does
gathers pages from the largest extents first. Freed pages merge back with their neighbours.
"""

from __future__ import annotations

import bisect

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument
from .errors import CacheFull


class PageAllocator:
    """Pages ``0 .. num_pages-1``. Not thread-safe: use it from the event loop."""

    def __init__(self, num_pages: int) -> None:
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 1:
            raise InvalidArgument(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._starts: list[int] = [0]  # sorted starts of free extents
        self._lens: dict[int, int] = {0: num_pages}
        self._free = num_pages

    @property
    def free_pages(self) -> int:
        return self._free

    def _take(self, start: int, n: int) -> None:
        length = self._lens.pop(start)
        i = bisect.bisect_left(self._starts, start)
        del self._starts[i]
        if n < length:
            self._starts.insert(i, start + n)
            self._lens[start + n] = length - n
        self._free -= n

    def alloc(self, n: int, *, contiguous: bool = False) -> npt.NDArray[np.int64]:
        """``n`` page indices (one run when a free extent holds them). ``contiguous``: one
        run or :class:`CacheFull`. Raises :class:`CacheFull` when fewer pages are free."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"page count must be a positive int, got {n!r}")
        if n > self._free:
            raise CacheFull(f"{n} pages asked for, {self._free} of {self.num_pages} free")
        fits = [s for s in self._starts if self._lens[s] >= n]
        if fits:
            start = min(fits, key=lambda s: (self._lens[s], s))  # best fit
            self._take(start, n)
            return np.arange(start, start + n, dtype=np.int64)
        if contiguous:
            biggest = max(self._lens.values())
            raise CacheFull(f"no run of {n} free pages (the longest is {biggest})")
        out: list[npt.NDArray[np.int64]] = []
        left = n
        for start in sorted(self._starts, key=lambda s: -self._lens[s]):
            take = min(left, self._lens[start])
            self._take(start, take)
            out.append(np.arange(start, start + take, dtype=np.int64))
            left -= take
            if not left:
                break
        return np.sort(np.concatenate(out))

    def free(self, pages: npt.ArrayLike) -> None:
        """Give pages back; freeing a page that is free (or out of range) raises before
        anything changes."""
        idx = np.unique(np.asarray(pages, dtype=np.int64))
        if idx.size == 0:
            return
        if idx[0] < 0 or idx[-1] >= self.num_pages:
            raise InvalidArgument(f"page index outside 0..{self.num_pages - 1}")
        runs = np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1)
        for run in runs:
            s, e = int(run[0]), int(run[-1]) + 1
            i = bisect.bisect_right(self._starts, s)
            if i and self._starts[i - 1] + self._lens[self._starts[i - 1]] > s:
                raise InvalidArgument(f"page {s} is already free")
            if i < len(self._starts) and self._starts[i] < e:
                raise InvalidArgument(f"page {self._starts[i]} is already free")
        for run in runs:
            self._insert(int(run[0]), int(run.size))

    def _insert(self, start: int, n: int) -> None:
        self._free += n
        i = bisect.bisect_left(self._starts, start)
        if i < len(self._starts) and self._starts[i] == start + n:  # merge with the next
            n += self._lens.pop(self._starts[i])
            del self._starts[i]
        if i and self._starts[i - 1] + self._lens[self._starts[i - 1]] == start:  # and the previous
            prev = self._starts[i - 1]
            self._lens[prev] += n
        else:
            self._starts.insert(i, start)
            self._lens[start] = n
