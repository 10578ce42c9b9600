"""The paged KV cache's memory layout, shared by prefiller and decoder.

Heads before pages: the cache is ``[layer][part][head][page][token][dim]`` (``part`` is K
and V, or the single latent of an MLA-style cache). One head's consecutive pages are then
contiguous, so a run of consecutive pages of a request moves as one large write per head
instead of one small write per page. A *block* is one head's page: ``tokens_per_page *
head_dim`` elements, the unit the paged writes address.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument

# Element sizes by dtype name (torch's names; bfloat16 and float8 have no numpy dtype).
ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
}

_FIELDS = struct.Struct("<IIIIIQIQ16s")


def _positive(name: str, value: object, hi: int = 1 << 31) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 1 <= int(value) <= hi:
        raise InvalidArgument(f"{name} must be an int in 1..{hi}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class KvCacheLayout:
    """A paged KV cache: ``num_pages`` pages of ``tokens_per_page`` tokens for each of
    ``num_layers`` layers, ``parts`` (2: K and V; 1: an MLA latent) and ``num_kv_heads``.
    ``tail_bytes`` is the per-request context written after the last layer (logits or the
    last hidden state); the decoder keeps ``tail_slots`` of them."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_page: int
    num_pages: int
    parts: int = 2
    tail_bytes: int = 0
    tail_slots: int = 64

    def __post_init__(self) -> None:
        _positive("num_layers", self.num_layers, 1 << 16)
        _positive("num_kv_heads", self.num_kv_heads, 1 << 16)
        _positive("head_dim", self.head_dim, 1 << 16)
        _positive("tokens_per_page", self.tokens_per_page, 1 << 20)
        _positive("num_pages", self.num_pages, 1 << 31)
        _positive("tail_slots", self.tail_slots, 1 << 20)
        if self.parts not in (1, 2):
            raise InvalidArgument(f"parts must be 2 (K and V) or 1 (an MLA latent), got {self.parts!r}")
        if self.dtype not in ITEMSIZE:
            raise InvalidArgument(f"dtype must be one of {sorted(ITEMSIZE)}, got {self.dtype!r}")
        if (
            isinstance(self.tail_bytes, bool)
            or not isinstance(self.tail_bytes, int)
            or not (0 <= self.tail_bytes <= 1 << 30)
        ):
            raise InvalidArgument(f"tail_bytes must be an int in 0..2**30, got {self.tail_bytes!r}")
        if self.total_bytes > 1 << 46:
            raise InvalidArgument(f"a cache of {self.total_bytes} bytes is not plausible")

    # ---- sizes ----

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """One head's page: the unit of a paged write (the paper's setting: 32 KiB)."""
        return self.tokens_per_page * self.head_dim * self.itemsize

    @property
    def blocks_per_layer(self) -> int:
        return self.parts * self.num_kv_heads

    @property
    def layer_bytes(self) -> int:
        return self.blocks_per_layer * self.num_pages * self.block_bytes

    @property
    def total_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def tail_region_bytes(self) -> int:
        return max(1, self.tail_bytes) * self.tail_slots

    def shape(self) -> tuple[int, int, int, int, int, int]:
        """The cache as an array: (layers, parts, heads, pages, tokens_per_page, head_dim)."""
        return (
            self.num_layers, self.parts, self.num_kv_heads, self.num_pages, self.tokens_per_page,
            self.head_dim,
        )  # fmt: skip

    def pages_for(self, num_tokens: int) -> int:
        return -(-int(num_tokens) // self.tokens_per_page)

    # ---- addressing ----

    def block_index(self, layer: int, part: int, head: int, page: int) -> int:
        """Index (in units of :attr:`block_bytes`) of one head's page of one layer."""
        return ((layer * self.parts + part) * self.num_kv_heads + head) * self.num_pages + page

    def layer_block_bases(self, layer: int) -> npt.NDArray[np.int64]:
        """Block index of page 0 of every (part, head) of ``layer``."""
        n = self.blocks_per_layer
        return (np.arange(n, dtype=np.int64) + layer * n) * self.num_pages

    def with_pages(self, num_pages: int) -> KvCacheLayout:
        """The same model's layout with another number of pages (a prefiller's staging
        cache is usually smaller than a decoder's)."""
        return KvCacheLayout(
            self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.tokens_per_page,
            num_pages, self.parts, self.tail_bytes, self.tail_slots,
        )  # fmt: skip

    def fingerprint(self) -> bytes:
        """16 bytes naming the model-side geometry (everything but the page and tail-slot
        counts, which differ between peers): a request from a decoder with another geometry
        is refused rather than written into the wrong places."""
        raw = _FIELDS.pack(
            self.num_layers, self.num_kv_heads, self.head_dim, self.tokens_per_page, self.parts,
            self.tail_bytes, self.itemsize, 0, self.dtype.encode().ljust(16, b"\0")[:16],
        )  # fmt: skip
        return hashlib.blake2b(raw, digest_size=16).digest()
