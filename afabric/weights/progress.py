"""Progress of one update: bytes written and the rate, as log lines at most once a second
(on stderr too when it is a terminal), and an optional callback after every slice."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

log = logging.getLogger("afabric.weights")

ProgressCallback = Callable[[int, int], None]
"""Called with ``(bytes_done, bytes_total)`` after each slice's writes complete."""


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 28 else f"{n / (1 << 20):.1f} MiB"


class UpdateProgress:
    def __init__(
        self,
        what: str,
        total: int,
        *,
        show: bool | None,
        callback: ProgressCallback | None,
        period: float = 1.0,
    ) -> None:
        self.what = what
        self.total = total
        self.done = 0
        self.callback = callback
        if show is None:
            isatty = getattr(sys.stderr, "isatty", None)
            show = bool(isatty()) if callable(isatty) else False
        self.show = show
        self.period = period
        self.t0 = time.perf_counter()
        self._last = self.t0

    def line(self) -> str:
        dt = max(time.perf_counter() - self.t0, 1e-9)
        pct = 100.0 * self.done / self.total if self.total else 100.0
        return (f"{self.what}: {_gib(self.done)} of {_gib(self.total)} ({pct:.0f}%), "
                f"{self.done / dt / 1e9:.2f} GB/s")  # fmt: skip

    def add(self, n: int) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)
        now = time.perf_counter()
        if now - self._last >= self.period:
            self._last = now
            self._emit()

    def finish(self) -> None:
        if self.done and time.perf_counter() - self.t0 >= self.period:
            self._emit()

    def _emit(self) -> None:
        text = self.line()
        log.info("%s", text)
        if self.show:
            print(text, file=sys.stderr, flush=True)
