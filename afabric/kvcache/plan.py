"""Which writes move a request: runs of pages, their split among replica prefillers, and
the paged writes of one layer.

A *segment* ``(pos, dst, n)`` says that prompt pages ``pos .. pos+n-1`` land in the
decoder's pages ``dst .. dst+n-1``. With the heads-before-pages layout a segment is one
contiguous span per (part, head) on both sides, so each becomes one write of ``n`` blocks,
and the decoder counts one arrival per segment per (part, head) per layer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument
from .layout import KvCacheLayout


def segments(pages: npt.ArrayLike, max_run: int) -> npt.NDArray[np.int64]:
    """Maximal runs of consecutive page indices (prompt order), each cut to ``max_run``
    pages: an (n, 3) array of (pos, dst, count)."""
    idx = np.asarray(pages, dtype=np.int64).reshape(-1)
    if max_run < 1:
        raise InvalidArgument(f"max_run must be >= 1, got {max_run}")
    if idx.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    out: list[tuple[int, int, int]] = []
    for start, stop in zip(np.r_[0, breaks], np.r_[breaks, idx.size], strict=True):
        for s in range(int(start), int(stop), max_run):
            n = min(max_run, int(stop) - s)
            out.append((s, int(idx[s]), n))
    return np.array(out, dtype=np.int64).reshape(-1, 3)


def split_among(segs: npt.NDArray[np.int64], ranks: int, rng: random.Random) -> list[npt.NDArray[np.int64]]:
    """Deal segments to ``ranks`` replica prefillers, balanced by pages and random in which
    rank gets which: segments are first cut so every rank can get work, then taken in a
    random order, each by the least-loaded rank (ties broken at random)."""
    if ranks < 1:
        raise InvalidArgument(f"ranks must be >= 1, got {ranks}")
    if ranks == 1:
        return [segs]
    total = int(segs[:, 2].sum()) if segs.size else 0
    piece = max(1, -(-total // ranks))
    cut: list[tuple[int, int, int]] = []
    for pos, dst, n in segs.tolist():
        for k in range(0, n, piece):
            cut.append((pos + k, dst + k, min(piece, n - k)))
    rng.shuffle(cut)
    load = [0] * ranks
    parts: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    for seg in cut:
        low = min(load)
        r = rng.choice([i for i, v in enumerate(load) if v == low])
        parts[r].append(seg)
        load[r] += seg[2]
    return [np.array(sorted(p), dtype=np.int64).reshape(-1, 3) for p in parts]


def arrivals(layout: KvCacheLayout, segs: npt.NDArray[np.int64]) -> int:
    """Immediates the writes of these segments deliver: one per segment, (part, head) and layer."""
    return layout.num_layers * layout.blocks_per_layer * int(segs.shape[0])


@dataclass(frozen=True)
class PagedWrite:
    """One ``write_paged`` call: blocks of ``page_len`` bytes at ``src_idx`` / ``dst_idx``
    (in units of the layout's block size, so the stride of both sides is one block)."""

    page_len: int
    src_idx: npt.NDArray[np.int64]
    dst_idx: npt.NDArray[np.int64]


def layer_writes(
    src: KvCacheLayout, dst: KvCacheLayout, layer: int, segs: npt.NDArray[np.int64], first_page: int
) -> list[PagedWrite]:
    """The writes of one layer: segments grouped by length, one call per length. The
    source is a contiguous staging run starting at page ``first_page`` of ``src``."""
    out: list[PagedWrite] = []
    if segs.size == 0:
        return out
    src_base = src.layer_block_bases(layer)[:, None]  # (blocks, 1)
    dst_base = dst.layer_block_bases(layer)[:, None]
    for n in np.unique(segs[:, 2]).tolist():
        sel = segs[segs[:, 2] == n]
        s = (src_base + (sel[:, 0] + first_page)[None, :]).reshape(-1)
        d = (dst_base + sel[:, 1][None, :]).reshape(-1)
        out.append(PagedWrite(int(n) * src.block_bytes, s, d))
    return out
