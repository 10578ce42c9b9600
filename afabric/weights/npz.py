"""Arrays out of an ``.npz`` that may come from a peer, without trusting what it declares.

numpy's loader allocates the array a member's ``.npy`` header declares before reading its
data, so a few hundred bytes declaring 2**40 elements ask for 8 TiB. Here each member's
declared shape and dtype are checked against the bytes the member actually holds first,
and only what :func:`numpy.savez` writes is taken: an uncompressed zip of exactly the
expected ``.npy`` members (a stored member lies inside the blob, so nothing read is larger
than the blob itself).
"""

from __future__ import annotations

import io
import math
import zipfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument

_MAX_HEADER = 10000  # numpy's own default bound on a .npy header's length


def read_members(
    blob: bytes, members: Mapping[str, tuple[np.dtype[Any], int]]
) -> dict[str, npt.NDArray[Any]]:
    """The arrays of ``blob`` by name: exactly ``members`` (name -> dtype and number of
    dimensions), each a C-ordered copy owning its memory.

    Raises :class:`InvalidArgument` for what it checks; malformed bytes may also raise
    zipfile's or numpy's own errors (``BadZipFile``, ``ValueError``...), which the caller
    turns into its own message."""
    expected = {f"{name}.npy": name for name in members}
    with zipfile.ZipFile(io.BytesIO(blob)) as zf:
        infos = zf.infolist()
        names = sorted(i.filename for i in infos)
        if names != sorted(expected):
            raise InvalidArgument(f"members {names[:8]}, expected {sorted(expected)}")
        out: dict[str, npt.NDArray[Any]] = {}
        for info in infos:
            name = expected[info.filename]
            if info.flag_bits & 0x1:
                raise InvalidArgument(f"{name}: an encrypted member")
            if info.compress_type != zipfile.ZIP_STORED:
                raise InvalidArgument(f"{name}: a compressed member (method {info.compress_type})")
            if info.file_size > len(blob):
                raise InvalidArgument(f"{name}: declares {info.file_size} bytes in a {len(blob)}-byte blob")
            dtype, ndim = members[name]
            out[name] = _array(zf.read(info), dtype, ndim, name)  # read() checks the CRC
    return out


def _array(raw: bytes, dtype: np.dtype[Any], ndim: int, name: str) -> npt.NDArray[Any]:
    f = io.BytesIO(raw)
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, fortran, got = np.lib.format.read_array_header_1_0(f, max_header_size=_MAX_HEADER)
    elif version == (2, 0):
        shape, fortran, got = np.lib.format.read_array_header_2_0(f, max_header_size=_MAX_HEADER)
    else:
        raise InvalidArgument(f"{name}: .npy format version {version}")
    if got != dtype:
        raise InvalidArgument(f"{name}: dtype {got}, expected {dtype}")
    if len(shape) != ndim or any(n < 0 for n in shape):
        raise InvalidArgument(f"{name}: shape {shape[:8]}, expected {ndim} dimensions")
    start = f.tell()
    count = math.prod(shape)
    if count * dtype.itemsize != len(raw) - start:
        raise InvalidArgument(
            f"{name}: header declares {shape} of {dtype} ({count * dtype.itemsize} bytes), "
            f"the member holds {len(raw) - start}"
        )
    flat = np.frombuffer(raw, dtype=dtype, count=count, offset=start)
    out: npt.NDArray[Any] = flat.reshape(shape, order="F" if fortran else "C").copy(order="C")
    return out
