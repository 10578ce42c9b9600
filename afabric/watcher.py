"""UVM watchers: a 64-bit word that a GPU kernel (or any writer) bumps, watched by the shim.

The word lives in pinned host memory mapped into the GPU's address space when the engine
is asked for a CUDA watcher (``eng.uvm_watcher(device=0)``; hand ``device_ptr`` to a
kernel), and in plain host memory otherwise. A thread in the shim watches it and reports
each change it observes as ``(old, new)``; the same change fires operations armed with
``when=watcher.reaches(value)``.
"""

from __future__ import annotations

import asyncio
import collections
import weakref
from collections.abc import AsyncIterator
from typing import Protocol

from . import _native
from .errors import EngineClosed, InvalidArgument
from .triggers import Trigger, watcher_reaches


class EngineView(Protocol):
    """What a watcher needs of its engine (:class:`afabric.Engine`, which imports this module
    to make watchers): declared here so this module stands below the engine."""

    _n: _native.NativeEngine

    @property
    def closed(self) -> bool: ...

    def _forget_watcher(self, w: UvmWatcher) -> None: ...

# Changes kept for a reader that is not reading; beyond it the oldest two merge into one
# (old of the first, new of the second), so the chain of values stays unbroken.
_BACKLOG = 65536


class UvmWatcher:
    """A watched word. ``async for old, new in watcher`` sees every change the shim
    observed, in order; ``await watcher.wait_for(v)`` returns once the word is >= v."""

    def __init__(
        self, engine: EngineView, watcher_id: int, host_ptr: int, device_ptr: int, device: int
    ) -> None:
        self._engine: weakref.ref[EngineView] = weakref.ref(engine)
        self.id = watcher_id
        self.host_ptr = host_ptr
        """Address of the word in this process (a CPU writer can store to it)."""
        self.device_ptr = device_ptr
        """Address of the same word for kernels on ``device`` (0 for a host watcher)."""
        self.device = device
        self._seen = 0  # the newest value reported by the shim
        self._events: collections.deque[tuple[int, int]] = collections.deque()
        self._wakeup: asyncio.Event = asyncio.Event()
        self._closed = False

    # ---- writers ----

    def add(self, delta: int = 1) -> int:
        """Atomically add to the word, as a CPU-side writer; any thread may call it.

        Args:
            delta: the amount to add.

        Returns:
            The word's new value.

        Raises:
            EngineClosed: the watcher or its engine is closed.
            InvalidArgument: ``delta`` is negative or not an int.
        """
        eng = self._live()
        if isinstance(delta, bool) or not isinstance(delta, int) or delta < 0:
            raise InvalidArgument(f"delta must be a non-negative int, got {delta!r}")
        return eng._n.watcher_add(self.id, delta)

    @property
    def value(self) -> int:
        """The word as it is now (read directly, not through the watcher thread).

        Returns:
            The 64-bit value.

        Raises:
            EngineClosed: the watcher or its engine is closed.
        """
        self._live()
        return _native.read_u64(self.host_ptr)

    # ---- readers ----

    def reaches(self, value: int) -> Trigger:
        """A trigger for ``when=``: fire once the word is >= ``value``.

        Args:
            value: the threshold.

        Returns:
            The trigger.

        Raises:
            InvalidArgument: ``value`` is not a u64.
        """
        self._live()
        return watcher_reaches(self.id, value, f"watcher {self.id & 0xFFFFFFFF}")

    async def wait_for(self, value: int) -> int:
        """Wait until the shim observed the word at ``value`` or more.

        Args:
            value: the threshold.

        Returns:
            The value observed.

        Raises:
            EngineClosed: the watcher or its engine closed first.
        """
        while self._seen < value:
            self._live()
            self._wakeup.clear()
            await self._wakeup.wait()
        return self._seen

    def __aiter__(self) -> AsyncIterator[tuple[int, int]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, int]]:
        while True:
            while self._events:
                yield self._events.popleft()
            self._live()
            self._wakeup.clear()
            await self._wakeup.wait()

    def _observed(self, old: int, new: int) -> None:
        """Called by the engine (loop thread) for each change record."""
        self._seen = new
        self._events.append((old, new))
        if len(self._events) > _BACKLOG:
            first_old, _ = self._events.popleft()
            _, second_new = self._events.popleft()
            self._events.appendleft((first_old, second_new))
        self._wakeup.set()

    # ---- lifetime ----

    def _live(self) -> EngineView:
        eng = self._engine()
        if self._closed or eng is None or eng.closed:
            raise EngineClosed("watcher is closed (or its engine is)")
        return eng

    def close(self) -> None:
        """Stop watching; idempotent.

        The word stays valid until the engine closes (a kernel may still be storing to it).
        """
        if self._closed:
            return
        self._closed = True
        eng = self._engine()
        if eng is not None and not eng.closed:
            eng._forget_watcher(self)
        self._wakeup.set()

    def _engine_closed(self) -> None:
        self._closed = True
        self._wakeup.set()

    def __repr__(self) -> str:
        where = "host" if self.device < 0 else f"cuda:{self.device}"
        return f"UvmWatcher({where}, seen={self._seen}{', closed' if self._closed else ''})"
