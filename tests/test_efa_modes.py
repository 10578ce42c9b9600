"""The EFA code paths on software providers: under `afabric.testing.force_efa_modes()` (a
testing hook, not an Engine argument) the provider library
behaves as if FI_RX_CQ_DATA (immediates consume posted receives), FI_MR_LOCAL and
provider-chosen keys were required, so those paths run in CI without an EFA device."""

from __future__ import annotations

import numpy as np
import pytest

import afabric
from afabric import _native, testing

from .procs import Ctl, Peer

MiB = 1 << 20
CHUNKS, PAGES, PAGE = 16, 2000, 512


async def efa_target(ctl: Ctl, provider: str) -> int:
    with testing.force_efa_modes():
        eng = afabric.Engine(provider, rx_depth=32)
    async with eng:
        assert eng.caps & _native.CAP_IMM_NEEDS_RECV and eng.caps & _native.CAP_MR_LOCAL
        contig = np.zeros(CHUNKS * MiB, dtype=np.uint8)
        paged = np.zeros(PAGES * PAGE, dtype=np.uint8)
        m1, m2 = eng.register(contig), eng.register(paged)
        imm = eng.alloc_imm()
        ctl.put((bytes(m1.descriptor), bytes(m2.descriptor), imm, bytes(eng.address)))
        # every chunk and every page carries the immediate: a burst far larger than the
        # 32 posted receives, which must be reposted as immediates consume them
        await eng.expect_imm(imm, CHUNKS + PAGES, timeout=60)
        src = np.random.default_rng(3).integers(0, 256, CHUNKS * MiB, dtype=np.uint8)
        assert np.array_equal(contig, src)
        perm = np.random.default_rng(4).permutation(PAGES)
        assert np.array_equal(paged.reshape(PAGES, PAGE)[perm], src[: PAGES * PAGE].reshape(PAGES, PAGE))
        msg = await eng.recv_bytes()
        assert msg == b"after the burst"
        return CHUNKS + PAGES


def test_force_efa_modes_is_a_scoped_testing_hook() -> None:
    """Not an Engine argument (public signatures carry no test switches); on only inside
    the `with`."""
    with pytest.raises(TypeError, match="force_efa_modes"):
        afabric.Engine("tcp", force_efa_modes=True)  # type: ignore[call-arg]
    assert not testing.efa_modes_forced()
    with testing.force_efa_modes():
        assert testing.efa_modes_forced()
        with testing.force_efa_modes(False):
            assert not testing.efa_modes_forced()
        assert testing.efa_modes_forced()
    assert not testing.efa_modes_forced()


async def test_efa_modes_on_software_provider(provider: str, peers: list[Peer]) -> None:
    p = Peer(efa_target, provider)
    peers.append(p)
    d1, d2, imm, addr = await p.get()
    with testing.force_efa_modes():
        eng = afabric.Engine(provider)
    async with eng:
        assert eng.caps & _native.CAP_PROV_KEY
        src = np.random.default_rng(3).integers(0, 256, CHUNKS * MiB, dtype=np.uint8)
        mr = eng.register(src)
        desc1, desc2 = afabric.MrDesc.from_bytes(d1), afabric.MrDesc.from_bytes(d2)
        for i in range(CHUNKS):
            await eng.write(mr, desc1, MiB, src_offset=i * MiB, dst_offset=i * MiB, imm=imm)
        perm = np.random.default_rng(4).permutation(PAGES)
        await eng.write_paged(
            mr,
            desc2,
            page_len=PAGE,
            src_pages=afabric.Pages(np.arange(PAGES), PAGE),
            dst_pages=afabric.Pages(perm, PAGE),
            imm=imm,
        )
        await eng.send(afabric.Address.from_bytes(addr), b"after the burst")
        assert await p.result() == CHUNKS + PAGES
