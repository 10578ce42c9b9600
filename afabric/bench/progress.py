"""Progress of long benchmark sweeps, on stderr.

On a terminal, a one-line bar ``[#####.....] 5/14 write 1 MiB``: it redraws in place
(carriage return), is cut to the terminal's width and is wiped by :meth:`Progress.close`,
so the results printed afterwards start on a clean line. Redirected to a file or a pipe,
plain lines instead, one per step that starts (``afabric: 5/14 write 1 MiB (12.3 s)``) and
at most one every :data:`LINE_EVERY_S` seconds otherwise, so a piped run is never silent
for long and a log stays short. No dependencies; nothing here runs inside a measured loop
(callers step it between measurements).
"""

from __future__ import annotations

import shutil
import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["LINE_EVERY_S", "Progress"]

LINE_EVERY_S = 10.0  # not a terminal: at most one line this often, besides a line per new step


class Progress:
    """``total`` steps; :meth:`step` announces the one starting now, :meth:`advance` counts
    finished ones. ``enabled=None`` (the default) means: a bar when ``stream`` is a
    terminal; ``lines=None`` means: plain lines when it is not (``False``: silent then)."""

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        width: int = 20,
        enabled: bool | None = None,
        lines: bool | None = None,
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
        self._label = ""
        self._shown = 0  # characters on the line now
        self._t0 = time.monotonic()
        self._last_line = float("-inf")
        self._last_label: str | None = None

    def line(self) -> str:
        """The bar as text (without the carriage return), e.g. ``[##........] 1/10 write 8 B``."""
        frac = self.done / self.total if self.total else 1.0
        filled = min(self.width, int(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {min(self.done, self.total)}/{self.total}"
        return f"{text} {self._label}" if self._label else text

    def step(self, label: str) -> None:
        """Show that the step called ``label`` is running now (``done`` counts those before it)."""
        self._label = label
        self._draw()
        self._line(force=label != self._last_label)

    def advance(self, n: int = 1, label: str | None = None) -> None:
        """Count ``n`` more steps as finished (and optionally change the label)."""
        self.done = min(self.total, self.done + n)
        if label is not None:
            self._label = label
        self._draw()
        self._line(force=self.done == self.total)

    def close(self) -> None:
        """Wipe the bar; the next write to the terminal starts at the left margin."""
        if self.enabled and self._shown:
            self._write("\r" + " " * self._shown + "\r")
        self._shown = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _draw(self) -> None:
        if not self.enabled:
            return
        cols = shutil.get_terminal_size((80, 24)).columns
        text = self.line()[: max(10, cols - 1)]
        pad = " " * max(0, self._shown - len(text))  # rub out the end of a longer previous line
        self._write("\r" + text + pad)
        self._shown = len(text)

    def _line(self, force: bool) -> None:
        if not self.lines:
            return
        now = time.monotonic()
        if not force and now - self._last_line < LINE_EVERY_S:
            return
        self._last_line = now
        self._last_label = self._label
        text = f"{min(self.done, self.total)}/{self.total}"
        if self._label and self.done < self.total:
            text += f" {self._label}"
        elif self.done >= self.total:
            text += " done"
        self._write(f"afabric: {text} ({now - self._t0:.1f} s)\n")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: progress is not worth failing for
            self.enabled = False
            self.lines = False
