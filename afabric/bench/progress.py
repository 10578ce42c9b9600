"""A one-line progress bar for long benchmark sweeps, on stderr, only when stderr is a terminal.

``[#####.....] 5/14 write 1 MiB``: the bar redraws in place (carriage return), is cut to the
terminal's width and is wiped by :meth:`Progress.close`, so the results printed afterwards
start on a clean line. Redirected to a file or a pipe it writes nothing at all. No
dependencies; nothing here runs inside a measured loop (callers step it between measurements).
"""

from __future__ import annotations

import shutil
import sys
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """``total`` steps; :meth:`step` announces the one starting now, :meth:`advance` counts
    finished ones. ``enabled=None`` (the default) means: when ``stream`` is a terminal."""

    def __init__(
        self, total: int, *, stream: TextIO | None = None, width: int = 20, enabled: bool | None = None
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
        self._label = ""
        self._shown = 0  # characters on the line now

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

    def advance(self, n: int = 1, label: str | None = None) -> None:
        """Count ``n`` more steps as finished (and optionally change the label)."""
        self.done = min(self.total, self.done + n)
        if label is not None:
            self._label = label
        self._draw()

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

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # the terminal went away: progress is not worth failing for
            self.enabled = False
