"""afabric.host_buffer: memory that same-host copies (cma's process_vm_writev) land in over
transparent huge pages. The alignment and the kernel's view of the mapping (smaps'
THPeligible: the advice took) are asserted, not the speed (docs/performance.md measures that)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import afabric
from afabric import errors
from afabric.hostmem import HUGE_PAGE

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def smaps_entry(addr: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds addr."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            if inside:
                break
            inside = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    assert fields, f"no mapping holds {addr:#x}"
    return fields


def test_aligned_zeroed_writable() -> None:
    n = 3 * HUGE_PAGE + 5
    buf = afabric.host_buffer(n)
    assert (buf.dtype, buf.shape, buf.flags.writeable) == (np.uint8, (n,), True)
    assert buf.ctypes.data % HUGE_PAGE == 0
    assert not buf.any()
    buf[:] = 7
    assert int(buf[-1]) == 7


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="transparent huge pages are off here"
)
def test_advised_for_huge_pages() -> None:
    """The kernel takes the whole buffer as eligible for huge pages (where THP is 'madvise',
    only advised memory is)."""
    buf = afabric.host_buffer(4 * HUGE_PAGE)
    buf[:] = 1  # touched after the advice: faulted in as huge pages where the kernel has them
    entry = smaps_entry(buf.ctypes.data)
    assert entry.get("THPeligible") == "1", entry
    assert int(entry["Size"].split()[0]) * 1024 >= buf.nbytes, entry


def test_views_keep_the_mapping() -> None:
    """The array (or a view, or a registration) keeps its mapping: no use after unmap."""
    view = afabric.host_buffer(HUGE_PAGE)[10:20]
    view[:] = 3
    assert view.sum() == 30


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True])
def test_bad_sizes(bad: object) -> None:
    with pytest.raises(errors.InvalidArgument):
        afabric.host_buffer(bad)  # type: ignore[arg-type]


def test_zero_bytes() -> None:
    empty = afabric.host_buffer(0)
    assert (empty.dtype, empty.shape) == (np.uint8, (0,))


async def test_cma_writes_into_it() -> None:
    """Registered as a target, it takes a same-host write whole (every byte checked)."""
    async with afabric.Engine("cma") as target, afabric.Engine("cma") as writer:
        dst = afabric.host_buffer(2 * HUGE_PAGE)
        desc = target.register(dst, remote="w").descriptor
        src = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
        mr = writer.register(src)
        await writer.write(mr, desc, src.nbytes, dst_offset=4096)
        assert np.array_equal(dst[4096 : 4096 + src.nbytes], src)
        assert not dst[:4096].any() and not dst[4096 + src.nbytes :].any()
