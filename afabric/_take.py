"""How long a write awaited alone is looked for in the call that submits it (afs_submit_take).

Found there, its completion costs no future, no drain and no loop iteration: 1.8-2.2 µs from
completion to resumption against 7.6-8.2 through the poll tick (16-core GPU machine,
`docs/bench/issue15/latsplit.py`). A look of one poll slice (5 µs) finds shm's and cma's
8 B writes but not tcp's, whose completions come 16-18 µs after posting (the target's
acknowledgement). So the window follows what the last writes found there took, up to the
engine's ``spin_us`` (the loop polls that long after a completion anyway): each one found
sets it to 1.5x its time plus 1 µs, each one missed doubles it, and one missed at the cap
(a slow peer, a large write) puts it back to the slice for the next ``_REST`` writes, so the
loop is not held for completions that will not come in time."""

from __future__ import annotations

_REST = 64


class TakeWindow:
    """The look's length for the next write awaited alone, in ns (``ns``)."""

    __slots__ = ("_base", "_cap", "_rest", "ns")

    def __init__(self, base_ns: int, cap_ns: int) -> None:
        self._base, self._cap = base_ns, max(base_ns, cap_ns)
        self.ns, self._rest = base_ns, 0

    def found(self, took_ns: int) -> None:
        self.ns, self._rest = min(self._cap, max(self._base, took_ns + took_ns // 2 + 1000)), 0

    def missed(self) -> None:
        if self.ns >= self._cap and self._cap > self._base:
            self.ns, self._rest = self._base, _REST
        elif self._rest:
            self._rest -= 1
        else:
            self.ns = min(self._cap, 2 * self.ns)
