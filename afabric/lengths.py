"""Write lengths read from memory when the write starts (``Engine.write(length_from=...)``).

A triggered write is armed before its data exists. When the producer (a GPU kernel, say)
also stores how much it produced into a word of host memory before firing the trigger, the
shim reads that word the moment the write fires and sends only that many bytes, instead of
the whole capacity every time.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import InvalidArgument
from .memory import MemoryRegion

_I64 = 1 << 63
_U64 = 1 << 64


@dataclass(frozen=True)
class LengthFrom:
    """The length of a write is ``clamp(base + scale * n, 0, length)``, where ``n`` is the
    little-endian u32 at byte ``offset`` of ``region`` (registered host memory, 4-aligned)
    read when the write starts, and ``length`` the write's own argument (its maximum, which
    every range check uses). A write with an immediate that comes out empty still delivers
    its immediate."""

    region: MemoryRegion
    offset: int
    scale: int = 1
    base: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.region, MemoryRegion):
            got = type(self.region).__name__
            raise InvalidArgument(f"length_from region must be a MemoryRegion, got {got}")
        for name, v, lo, hi in (
            ("offset", self.offset, 0, _U64),
            ("scale", self.scale, 0, _U64),
            ("base", self.base, -_I64, _I64),
        ):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
                raise InvalidArgument(f"length_from {name} must be an int in {lo}..{hi - 1}, got {v!r}")
        if self.offset % 4:
            raise InvalidArgument(f"length_from offset {self.offset} is not 4-aligned")
