"""Domain groups of several NICs. Here the "NICs" are several endpoints on one device
(tcp on loopback twice, shm twice), which exercises every sharding and round-robin path
on any machine; tests/test_netns.py runs the same over two real rails in network
namespaces, with byte counters and one rail slowed down."""

from __future__ import annotations

import numpy as np
import pytest

import afabric
from afabric import errors

from .procs import Ctl, Peer

MiB = 1 << 20
NICS = {"tcp": ["lo", "lo"], "shm": ["shm", "shm"]}


def data(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def two_nic_target(ctl: Ctl, provider: str, nbytes: int, npages: int, page: int) -> dict[str, int]:
    async with afabric.Engine(provider, nics=NICS[provider]) as eng:
        contig = np.zeros(nbytes, dtype=np.uint8)
        paged = np.zeros(npages * page, dtype=np.uint8)
        m1, m2 = eng.register(contig), eng.register(paged)
        imm = eng.alloc_imm()
        ctl.put((bytes(m1.descriptor), bytes(m2.descriptor), imm))
        # one arrival per contiguous write (however it was sharded) and one per page
        await eng.expect_imm(imm, 4 + npages, timeout=60)
        assert np.array_equal(contig, data(nbytes, 1))
        perm = np.random.default_rng(2).permutation(npages)
        assert np.array_equal(paged.reshape(npages, page)[perm], data(npages * page, 3).reshape(npages, page))
        return {"landed": sum(n["landed"] for n in eng.stats()["nics"])}


async def test_two_nic_group_shards_and_spreads(provider: str, peers: list[Peer]) -> None:
    nbytes, npages, page = 32 * MiB, 512, 4096
    p = Peer(two_nic_target, provider, nbytes, npages, page)
    peers.append(p)
    d1, d2, imm = await p.get()
    async with afabric.Engine(provider, nics=NICS[provider]) as eng:
        assert eng.nics == 2 and afabric.MrDesc.from_bytes(d1).nics == 2
        src = data(nbytes, 1)
        mr = eng.register(src)
        desc = afabric.MrDesc.from_bytes(d1)
        quarter = nbytes // 4
        for k in range(4):  # 8 MiB each: every one is split over both NICs
            await eng.write(mr, desc, quarter, src_offset=k * quarter, dst_offset=k * quarter, imm=imm)
        pages = data(npages * page, 3)
        pmr = eng.register(pages)
        perm = np.random.default_rng(2).permutation(npages)
        await eng.write_paged(
            pmr,
            afabric.MrDesc.from_bytes(d2),
            page_len=page,
            src_pages=afabric.Pages(np.arange(npages), page),
            dst_pages=afabric.Pages(perm, page),
            imm=imm,
        )
        stats = eng.stats()["nics"]
        # both NICs carried about half of everything
        for nic in stats:
            assert nic["write_bytes"] >= (nbytes + npages * page) // 3, stats
        await p.result()


async def test_group_sizes_must_match(provider: str) -> None:
    async with afabric.Engine(provider, nics=NICS[provider]) as two, afabric.Engine(provider) as one:
        mr = one.register(np.zeros(64, np.uint8))
        with pytest.raises(errors.InvalidArgument, match="NICs per group"):
            await one.write(mr, two.register(np.zeros(64, np.uint8)).descriptor, 8)
    with pytest.raises(errors.InvalidArgument):
        afabric.Engine(provider, nic="lo", nics=2)
    with pytest.raises(errors.InvalidArgument):
        afabric.Engine(provider, nics=9)
    with pytest.raises(errors.ProviderUnavailable):
        afabric.Engine(provider, nics=["no-such-nic"])
