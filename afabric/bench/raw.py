"""The one place the benchmarks reach below afabric's public API.

The benchmarks use the public API, with three exceptions: measurements the API deliberately
does not offer. They read the engine's private state here and nowhere else, so a change
inside :class:`afabric.Engine` has this one file to follow:

- :class:`RawLoop`: the shim's raw C loops (``afs_bench_write``, ``afs_bench_read``,
  ``afs_bench_paged``) on a registered region and an imported descriptor. They drive the
  submit path that ``Engine.write``/``read``/``write_paged`` use, from C, with no Python
  per operation: the ``raw`` column of ``afabric bench p2p`` and its raw latency. Requests
  they post reach the worker's completion path through its one hook for this
  (``afs_done_hook``, shim/internal.h), never the completion ring.
- :func:`record_first_posts`: the time the worker first posted each triggered write
  (``afabric bench trigger``: bump-to-post latency).
- :func:`watcher_store`: a store into a watcher's word made by the shim, which reads the
  clock just before it, as a GPU kernel's store would be timed (``afabric bench trigger``).

:func:`shim_path` names the shim library a run loaded, for the results' header.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from .. import _native
from ..descriptor import MrDesc
from ..engine import Engine
from ..memory import MemoryRegion
from ..watcher import UvmWatcher


class RawLoop:
    """The raw C loops from ``mr`` (registered with ``eng``) to the region ``desc``
    describes: the descriptor is imported once, as the engine's own writes import it, so
    both loops write through the same remote entry."""

    def __init__(self, eng: Engine, mr: MemoryRegion, desc: MrDesc) -> None:
        self._n = eng._n
        self._mr_id = mr.check(eng)
        self._rid, _ = eng._remote(desc)

    def write(self, length: int, window: int, iters: int) -> int:
        """Nanoseconds for ``iters`` contiguous writes of ``length`` bytes, ``window`` in
        flight (rotating through the region in slots of ``length``, as the Python rows do)."""
        return self._n.bench_write(self._mr_id, self._rid, length, window, iters)

    def latency(self, length: int, iters: int) -> npt.NDArray[np.uint64]:
        """Each of ``iters`` writes of ``length`` bytes, one at a time: ns from its
        submission to the loop seeing it complete (the awaited write's raw counterpart)."""
        return self._n.bench_write_lat(self._mr_id, self._rid, length, iters)

    def read(self, length: int, window: int, iters: int) -> int:
        """Nanoseconds for ``iters`` contiguous reads of ``length`` bytes into ``mr``,
        ``window`` in flight (the same slots as :meth:`write`)."""
        return self._n.bench_read(self._mr_id, self._rid, length, window, iters)

    def paged(
        self,
        page_len: int,
        src_idx: npt.NDArray[np.int64],
        dst_idx: npt.NDArray[np.int64],
        window: int,
        iters: int,
    ) -> int:
        """Nanoseconds for ``iters`` paged writes of ``len(src_idx)`` pages, ``window`` in flight."""
        return self._n.bench_paged(self._mr_id, self._rid, page_len, src_idx, dst_idx, window, iters)


def record_first_posts(eng: Engine, sink: collections.deque[tuple[int, int]] | None) -> None:
    """From now on append ``(operation id, first post time in ns)`` to ``sink`` for every
    completed operation the worker stamped (triggered writes); ``None`` stops it."""
    eng._first_posts = sink


def watcher_store(eng: Engine, watcher: UvmWatcher) -> Callable[[int], int]:
    """A function storing its argument into ``watcher``'s word through the shim and returning
    the clock (ns, CLOCK_MONOTONIC) read in C just before the store. Safe to call from
    another thread while the watcher is open."""
    store, watcher_id = eng._n.watcher_store, watcher.id
    return lambda value: store(watcher_id, value)


def shim_path() -> str:
    """The path of the shim library this process loaded (recorded with every result)."""
    return _native.shim().path


def copy_to_address(address: int, data: bytes, length: int) -> None:
    """Copy bytes to a raw address of this process (the compat bench's managed buffers)."""
    _native.copy_to_address(address, data, length)


def bytes_at(address: int, length: int) -> bytes:
    """Bytes read from a raw address of this process."""
    return _native.bytes_at(address, length)
