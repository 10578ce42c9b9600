"""Inference-side sharding: what each inference rank holds, and where in its buffer.

An inference rank's weights are :class:`DestTensor` s, each the concatenation along
dimension 0 of :class:`Part` s, each part a box of one training parameter. That covers
tensor-parallel splits (a part is a row or column slice), fused projections (q/k/v or
gate/up: several parts) and plain copies (one part, the whole parameter). A tensor may be
fp8 (``float8_e4m3fn``) with one float32 scale per ``block`` x ``block`` tile, as
DeepSeek-V3's checkpoints store it (``weight ≈ fp8 * scale``); the scales are a second
tensor, ``<name>.scale``, transferred with the weights.

:class:`RankLayout` packs one rank's tensors into one buffer (what gets registered),
after a header of version words: ``begin[i]`` and ``done[i]`` for every training rank
``i``, written by that rank before and after its writes of an update.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import InvalidArgument
from .meta import Box, box_shape, dtype_size

FP8 = "float8_e4m3fn"
"""The dtype name of fp8 destination tensors (torch's e4m3)."""
ALIGN = 256
"""Every tensor starts on a 256-byte boundary of the rank's buffer."""


@dataclass(frozen=True)
class Part:
    """Rows of a destination tensor that come from ``source``'s slice ``box``."""

    source: str
    box: Box


@dataclass(frozen=True)
class DestTensor:
    """One tensor of an inference rank: ``parts`` stacked along dimension 0."""

    name: str
    dtype: str
    parts: tuple[Part, ...]
    block: int = 128  # fp8 scale tile (rows and columns)

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        if not self.parts:
            raise InvalidArgument(f"{self.name}: a tensor needs at least one part")
        tail = box_shape(self.parts[0].box)[1:]
        for p in self.parts:
            shp = box_shape(p.box)
            if not shp or any(n <= 0 for n in shp):
                raise InvalidArgument(f"{self.name}: part from {p.source} has an empty box {p.box}")
            if shp[1:] != tail:
                raise InvalidArgument(f"{self.name}: parts differ beyond dimension 0 ({shp} vs {tail})")
        if self.fp8:
            if len(self.shape) != 2:
                raise InvalidArgument(f"{self.name}: fp8 tensors must be 2-d, got shape {self.shape}")
            if self.block <= 0:
                raise InvalidArgument(f"{self.name}: block must be positive")
            for p in self.parts[:-1]:
                rows = box_shape(p.box)[0]
                if rows % self.block:
                    raise InvalidArgument(
                        f"{self.name}: part from {p.source} has {rows} rows, not a multiple of the "
                        f"{self.block}-row scale block (only the last part may end mid-block)"
                    )
            for p in self.parts:
                for d, (lo, _hi) in enumerate(p.box):
                    if lo % self.block:
                        raise InvalidArgument(
                            f"{self.name}: part from {p.source} starts at {lo} in dimension {d}, "
                            f"not on a {self.block} block boundary"
                        )

    @property
    def fp8(self) -> bool:
        return self.dtype == FP8

    @property
    def shape(self) -> tuple[int, ...]:
        rows = sum(box_shape(p.box)[0] for p in self.parts)
        return (rows, *box_shape(self.parts[0].box)[1:])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)

    @property
    def scale_shape(self) -> tuple[int, int]:
        rows, cols = self.shape
        return -(-rows // self.block), -(-cols // self.block)

    @property
    def scale_nbytes(self) -> int:
        return math.prod(self.scale_shape) * 4 if self.fp8 else 0


@dataclass(frozen=True)
class Slot:
    """Where a tensor (and its fp8 scales) sits in a rank's buffer."""

    offset: int
    scale_offset: int  # -1 without scales


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class RankLayout:
    """One inference rank's tensors packed into one buffer after the version header."""

    def __init__(self, tensors: list[DestTensor] | tuple[DestTensor, ...], trainers: int) -> None:
        if trainers <= 0:
            raise InvalidArgument("at least one training rank")
        self.tensors = tuple(tensors)
        self.trainers = trainers
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise InvalidArgument("two destination tensors share a name")
        self.header_bytes = 16 * trainers
        off = _align(self.header_bytes)
        self.slots: dict[str, Slot] = {}
        for t in self.tensors:
            data = off
            off = _align(off + t.nbytes)
            scale = -1
            if t.fp8:
                scale = off
                off = _align(off + t.scale_nbytes)
            self.slots[t.name] = Slot(data, scale)
        self.nbytes = off

    def payload_bytes(self) -> int:
        """Bytes an update writes here (tensors and scales, no padding or header)."""
        return sum(t.nbytes + t.scale_nbytes for t in self.tensors)
