"""Host memory that same-host peers copy into fast: aligned to, and advised for, huge pages.

The cma provider's writer copies with process_vm_writev, which looks the target's pages up
one at a time: 1 MiB writes into 4 KiB pages moved 15-22 GB/s on the 2-core machine, into
transparent huge pages 48-52 (`afabric bench p2p --provider cma --quick --pattern fixed
--hugepages`, docs/providers/cma.md; libfabric 1.17's shm moved the same either way). numpy advises huge
pages for its large arrays, but an array's first and last bytes usually lie outside the
2 MiB-aligned part that can be huge, and torch advises none; advice also only reaches pages
not touched yet. host_buffer's memory is a private anonymous mapping, aligned to 2 MiB and
advised before anything touches it.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

from . import errors

HUGE_PAGE = 2 << 20
"""The alignment host_buffer gives (x86-64's and arm64's transparent huge page)."""


def host_buffer(nbytes: int) -> np.ndarray:
    """Zeroed host memory on a 2 MiB boundary, advised for transparent huge pages.

    Register it as the target of same-host (cma) writes: the kernel's copy runs 2-3x faster
    into huge pages. The kernel decides: with ``/sys/kernel/mm/transparent_hugepage/enabled``
    at ``never``, or no huge page free when a page is first touched, it gets 4 KiB pages. Up
    to 4 MiB of address space more than asked is reserved (touched pages only cost memory).
    The mapping lives as long as the array or any view or registration of it.

    Args:
        nbytes: bytes; 0 gives an empty array (no mapping).

    Returns:
        A uint8 numpy array of ``nbytes`` zeroed bytes.

    Raises:
        InvalidArgument: ``nbytes`` is negative or not an int, or that much cannot be
            mapped.
    """
    if type(nbytes) is not int or nbytes < 0:
        raise errors.InvalidArgument(f"host_buffer needs an int number of bytes >= 0, got {nbytes!r}")
    if nbytes == 0:
        return np.zeros(0, dtype=np.uint8)
    size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        mm = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, OverflowError) as e:
        raise errors.InvalidArgument(f"host_buffer({nbytes}): cannot map that much: {e}") from None
    whole = np.frombuffer(mm, dtype=np.uint8)  # keeps mm mapped while any view lives
    skip = -whole.ctypes.data % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel without THP: 4 KiB pages, still correct
            mm.madvise(advice, skip, size)
    return whole[skip : skip + nbytes]
