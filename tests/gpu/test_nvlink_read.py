"""nvlink READs (the copy in the other direction), on one GPU or more: two engines of one
process (cuda0 and the last GPU; the same GPU on a one-GPU machine) read contiguous, paged
and gathered CUDA memory byte-exact, and the export table refuses a read of a region
registered "w" even through a forged descriptor (and a write into an "r" one). Skipped,
not faked, without a CUDA GPU and CuPy (failed where AFABRIC_REQUIRE_GPU=1)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import struct
import zlib
from typing import Any, NoReturn

import numpy as np
import pytest

import afabric
from afabric import errors, registry

MiB = 1 << 20
PROVIDER = "nvlink"


def _unavailable(why: str) -> NoReturn:
    if os.environ.get("AFABRIC_REQUIRE_GPU") == "1":
        pytest.fail(f"AFABRIC_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


def _cp() -> tuple[Any, int]:
    """CuPy and the number of GPUs, or skip."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or CUDA libraries CuPy cannot load
        _unavailable(f"CuPy is not usable here ({type(e).__name__}: {e})")
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - no driver or no device
        _unavailable(f"no CUDA GPU ({type(e).__name__}: {e})")
    if n < 1:
        _unavailable("no CUDA GPU")
    avail = registry.probe(PROVIDER)
    if not avail.available:
        _unavailable(f"provider nvlink unavailable: {avail.reason}")
    return cupy, n


def pattern(n: int, seed: int) -> np.ndarray:
    x = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    return (x >> np.uint64(29)).astype(np.uint8)


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


def forge_access(d: afabric.MrDesc, access: int) -> afabric.MrDesc:
    blob = bytes(d)
    at = 8 + struct.unpack_from("<I", blob, 4)[0] + 24
    body = blob[:at] + struct.pack("<I", access) + blob[at + 4 : -4]
    return afabric.MrDesc.from_bytes(body + struct.pack("<I", zlib.crc32(body)))


def test_reads_two_engines() -> None:
    cp, ngpu = _cp()
    n, last = 16 * MiB, ngpu - 1

    async def main() -> None:
        e0 = afabric.Engine(PROVIDER, nic="cuda0")
        e1 = afabric.Engine(PROVIDER, nic=f"cuda{last}")
        try:
            h1, h2 = pattern(n, 31), pattern(n, 32)
            with cp.cuda.Device(last):
                src = cp.asarray(h1)
                src_w = cp.asarray(h2)
                cp.cuda.Device(last).synchronize()
            with cp.cuda.Device(0):
                dst = cp.zeros(n, dtype=cp.uint8)
            r_src = e1.register(src, remote="r")
            w_src = e1.register(src_w, remote="w")
            l_dst = e0.register(dst, remote=False)
            assert r_src.descriptor.access == "r"
            # contiguous: 16 reads of 1 MiB into reversed slots, concurrently
            await asyncio.gather(
                *(e0.read(l_dst, r_src.descriptor, MiB, src_offset=i * MiB, dst_offset=(15 - i) * MiB)
                  for i in range(16))
            )  # fmt: skip
            want = h1.reshape(16, MiB)[::-1].reshape(-1)
            assert sha(cp.asnumpy(dst)) == sha(want)
            # paged: shuffled 32 KiB pages
            pages = n // (32 * 1024)
            perm = np.random.default_rng(3).permutation(pages).astype(np.int64)
            await e0.read_paged(
                l_dst, r_src.descriptor, page_len=32 * 1024,
                src_pages=afabric.Pages(perm, 32 * 1024),
                dst_pages=afabric.Pages(np.arange(pages, dtype=np.int64), 32 * 1024),
            )  # fmt: skip
            assert sha(cp.asnumpy(dst)) == sha(h1.reshape(pages, -1)[perm].reshape(-1))
            # gather: two pieces of the same peer region
            await e0.gather(
                l_dst, [afabric.GatherSource(r_src.descriptor, MiB, 3 * MiB, 0),
                        afabric.GatherSource(r_src.descriptor, MiB, 0, MiB)],
            )  # fmt: skip
            got = cp.asnumpy(dst[: 2 * MiB])
            assert sha(got) == sha(np.concatenate([h1[3 * MiB : 4 * MiB], h1[:MiB]]))
            # access: refused before posting, and (forged) by the owner's export entry
            with pytest.raises(errors.RemoteKeyRejected, match="before posting"):
                await e0.read(l_dst, w_src.descriptor, MiB)
            before = sha(cp.asnumpy(dst))
            with pytest.raises(errors.RemoteKeyRejected, match="does not allow reads"):
                await e0.read(l_dst, forge_access(w_src.descriptor, 0x5), MiB)
            assert sha(cp.asnumpy(dst)) == before
            with pytest.raises(errors.RemoteKeyRejected, match="does not allow writes"):
                await e0.write(l_dst, forge_access(r_src.descriptor, 0x5), MiB)
            with cp.cuda.Device(last):
                assert sha(cp.asnumpy(src)) == sha(h1)
            st = e0.stats()["nics"][0]
            # the forged write and read were posted (the export entry refused them): counted
            assert st["reads"] >= 16 + pages + 2 + 1 and st["writes"] == 1 and st["errors"] == 2, st
        finally:
            await e0.aclose()
            await e1.aclose()

    asyncio.run(main())
