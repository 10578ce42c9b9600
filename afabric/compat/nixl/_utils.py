"""NIXL's test helpers (``nixl._utils``): aligned host buffers addressed by raw address.

Upstream allocates with ``aligned_alloc`` and touches memory through raw pointers. Here
each buffer is a numpy array kept alive in this module until ``free_passthru``; the other
helpers act only on ranges inside such a buffer (anything else raises ``ValueError``),
so a wrong address cannot crash the process.
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt

_ALIGN = 4096  # storage I/O with O_DIRECT needs block-aligned buffers, as upstream's
_lock = threading.Lock()
_buffers: dict[int, npt.NDArray[np.uint8]] = {}


def malloc_passthru(size: int) -> int:
    """A zeroed host buffer of ``size`` bytes aligned to 4 KiB; returns its address."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be an int >= 0, got {size!r}")
    raw = np.zeros(size + _ALIGN, dtype=np.uint8)
    skip = -raw.ctypes.data % _ALIGN
    buf = raw[skip : skip + size]
    addr = int(buf.ctypes.data)
    with _lock:
        _buffers[addr] = buf
    return addr


def free_passthru(buf: int) -> None:
    """Release a buffer from :func:`malloc_passthru` (the memory goes once nothing else,
    e.g. an agent's registration, references it)."""
    with _lock:
        if _buffers.pop(buf, None) is None:
            raise ValueError(f"0x{buf:x} is not a buffer from malloc_passthru")


def _view(addr: int, size: int) -> npt.NDArray[np.uint8]:
    with _lock:
        for start, arr in _buffers.items():
            if start <= addr and addr + size <= start + arr.nbytes:
                return arr[addr - start : addr - start + size]
    raise ValueError(f"[0x{addr:x}, +{size}) is not inside a buffer from malloc_passthru")


def ba_buf(addr: int, size: int) -> None:
    """Fill ``size`` bytes at ``addr`` with 0xba."""
    _view(addr, size)[:] = 0xBA


def verify_transfer(addr1: int, addr2: int, size: int) -> None:
    """Assert that ``size`` bytes at ``addr1`` and ``addr2`` are equal."""
    a, b = _view(addr1, size), _view(addr2, size)
    if not np.array_equal(a, b):
        first = int(np.flatnonzero(a != b)[0])
        raise AssertionError(f"transfer differs at byte {first}: {a[first]:#x} != {b[first]:#x}")
