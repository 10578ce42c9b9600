"""Progress of long benchmark sweeps, on stderr.

On a terminal, a one-line bar ``[#####.....] 5/14 write 1 MiB``: it redraws in place
(carriage return), is cut to the terminal's width and is wiped by :meth:`Progress.close`,
so the results printed afterwards start on a clean line. Redirected to a file or a pipe,
plain lines instead, one per step that starts (``afabric: 5/14 write 1 MiB (12.3 s)``) and
at most one every :data:`LINE_EVERY_S` seconds otherwise, so a log stays short. With
``weights`` or a ``heartbeat`` both also show the elapsed time and an ETA
(``... 12 s, ETA 40 s``).

A step can take a minute (a 64 MiB row of ``bench p2p --full``): with ``heartbeat`` a
thread of its own redraws the bar, or prints a line, whenever that many seconds passed
without one, so a run is never silent for longer. The ETA comes from the steps' ``weights``
(each step's estimated cost, in any unit), scaled by how fast the finished steps went.
No dependencies; nothing here runs inside a measured loop (callers step it between
measurements, and the heartbeat thread sleeps in between).
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import TextIO

__all__ = ["HEARTBEAT_S", "LINE_EVERY_S", "Progress"]

LINE_EVERY_S = 10.0  # not a terminal: at most one line this often, besides a line per new step
HEARTBEAT_S = 5.0  # with a heartbeat: something is shown at least this often during a long step


def _seconds(s: float) -> str:
    s = max(0.0, s)
    if s < 90:
        return f"{s:.0f} s"
    return f"{s / 60:.0f} min" if s < 5400 else f"{s / 3600:.1f} h"


class Progress:
    """``total`` steps; :meth:`step` announces the one starting now, :meth:`advance` counts
    finished ones. ``enabled=None`` (the default) means: a bar when ``stream`` is a
    terminal; ``lines=None`` means: plain lines when it is not (``False``: silent then).
    ``weights``: each step's estimated cost (seconds, or any unit: the finished steps'
    pace rescales it) for the ETA; ``heartbeat``: seconds after which a step still running
    is shown again (None: only when steps start or finish)."""

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        width: int = 20,
        enabled: bool | None = None,
        lines: bool | None = None,
        weights: Sequence[float] | None = None,
        heartbeat: float | None = None,
    ) -> None:
        self.total = max(0, int(total))
        self.done = 0
        self.stream = stream if stream is not None else sys.stderr
        self.width = max(1, width)
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            try:
                enabled = bool(isatty()) if callable(isatty) else False
            except ValueError:  # a closed stream
                enabled = False
        self.enabled = enabled
        self.lines = (not enabled) if lines is None else (lines and not enabled)
        if weights is not None and len(weights) != self.total:
            raise ValueError(f"{len(weights)} weights for {self.total} steps")
        self._weights = [max(0.0, float(w)) for w in weights] if weights is not None else None
        self._timed = weights is not None or heartbeat is not None  # elapsed and ETA shown
        self._label = ""
        self._shown = 0  # characters on the line now
        self._t0 = time.monotonic()
        self._t_done = self._t0  # when the last step finished
        self._last_line = float("-inf")
        self._last_shown = self._t0  # when anything was last drawn or printed
        self._last_label: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if heartbeat is not None and (self.enabled or self.lines):
            self._ticker = threading.Thread(
                target=self._tick, args=(float(heartbeat),), name="afabric-progress", daemon=True
            )
            self._ticker.start()

    def line(self) -> str:
        """The bar as text (without the carriage return), e.g. ``[##........] 1/10 write 8 B``."""
        frac = self.done / self.total if self.total else 1.0
        filled = min(self.width, int(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {min(self.done, self.total)}/{self.total}"
        return f"{text} {self._label}" if self._label else text

    def eta(self, now: float | None = None) -> float | None:
        """Seconds the remaining steps should take (None: no estimate yet, or finished)."""
        if self.done >= self.total:
            return None
        now = time.monotonic() if now is None else now
        w = self._weights or [1.0] * self.total
        done_w, left_w = sum(w[: self.done]), sum(w[self.done :])
        if done_w > 0:
            pace = (self._t_done - self._t0) / done_w  # seconds per unit, as measured so far
        elif self._weights is not None:
            pace = 1.0  # nothing finished yet: the weights taken as seconds
        else:
            return None
        in_step = now - self._t_done
        after_this = pace * (left_w - w[self.done])
        return max(pace * left_w - in_step, after_this)

    def step(self, label: str) -> None:
        """Show that the step called ``label`` is running now (``done`` counts those before it)."""
        with self._lock:
            self._label = label
            self._draw()
            self._line(force=label != self._last_label)

    def advance(self, n: int = 1, label: str | None = None) -> None:
        """Count ``n`` more steps as finished (and optionally change the label)."""
        with self._lock:
            self.done = min(self.total, self.done + n)
            self._t_done = time.monotonic()
            if label is not None:
                self._label = label
            self._draw()
            self._line(force=self.done == self.total)

    def close(self) -> None:
        """Stop the heartbeat and wipe the bar; the next write to the terminal starts at
        the left margin."""
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join(5.0)
        with self._lock:
            if self.enabled and self._shown:
                self._write("\r" + " " * self._shown + "\r")
            self._shown = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _tick(self, every: float) -> None:
        """The heartbeat thread: shows the step again once ``every`` seconds passed without
        anything shown (looks twice as often, so the gap stays under ``every`` plus a bit)."""
        while not self._stop.wait(max(0.05, every / 2)):
            with self._lock:
                if self._stop.is_set() or time.monotonic() - self._last_shown < every:
                    continue
                self._draw()
                self._line(force=True)

    def _timing(self, now: float) -> str:
        text = _seconds(now - self._t0) if self.enabled else f"{now - self._t0:.1f} s"
        eta = self.eta(now) if self._timed else None
        return text if eta is None else f"{text}, ETA {_seconds(eta)}"

    def _draw(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        cols = shutil.get_terminal_size((80, 24)).columns
        full = self.line()
        if self._timed and self.done < self.total:
            full += f" {self._timing(now)}"
        text = full[: max(10, cols - 1)]
        pad = " " * max(0, self._shown - len(text))  # rub out the end of a longer previous line
        self._write("\r" + text + pad)
        self._shown = len(text)
        self._last_shown = now

    def _line(self, force: bool) -> None:
        if not self.lines:
            return
        now = time.monotonic()
        if not force and now - self._last_line < LINE_EVERY_S:
            return
        self._last_line = self._last_shown = now
        self._last_label = self._label
        text = f"{min(self.done, self.total)}/{self.total}"
        if self._label and self.done < self.total:
            text += f" {self._label}"
        elif self.done >= self.total:
            text += " done"
        self._write(f"afabric: {text} ({self._timing(now)})\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: progress is not worth failing for
            self.enabled = False
            self.lines = False
