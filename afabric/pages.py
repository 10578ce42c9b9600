"""Page lists for paged writes: page i lives at ``offset + indices[i] * stride``."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from .errors import InvalidArgument


class Pages:
    """Where the pages of a paged write are. The indices go to the shim as one int64 array,
    so 10,000 pages are one call, not 10,000."""

    __slots__ = ("indices", "offset", "stride")

    def __init__(self, indices: npt.ArrayLike, stride: int, offset: int = 0) -> None:
        try:
            raw = np.asarray(indices)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"page indices must be integers: {e}") from e
        if raw.size and raw.dtype.kind not in "iu":
            raise InvalidArgument(f"page indices must be integers, got dtype {raw.dtype}")
        if raw.dtype.kind == "u" and raw.size and int(raw.max()) > np.iinfo(np.int64).max:
            raise InvalidArgument("page index does not fit in int64")
        arr = np.ascontiguousarray(raw, dtype=np.int64)
        if arr.ndim != 1:
            raise InvalidArgument(f"page indices must be one-dimensional, got shape {arr.shape}")
        if isinstance(stride, bool) or not isinstance(stride, (int, np.integer)) or int(stride) <= 0:
            raise InvalidArgument(f"page stride must be a positive integer, got {stride!r}")
        if isinstance(offset, bool) or not isinstance(offset, (int, np.integer)) or int(offset) < 0:
            raise InvalidArgument(f"page offset must be a non-negative integer, got {offset!r}")
        self.indices: npt.NDArray[np.int64] = arr
        self.stride = int(stride)
        self.offset = int(offset)

    def __len__(self) -> int:
        return int(self.indices.shape[0])

    def __repr__(self) -> str:
        return f"Pages({len(self)} pages, stride={self.stride}, offset={self.offset})"
