"""One-sided READ between real processes (tcp, shm): byte-exact contiguous, paged and
gather reads; bad input refused before anything is posted; what a region's access
(``remote="r" | "w" | "rw"``) lets a peer do, checked by the initiator and by the target's
provider; reads of deregistered regions; timeouts, triggers and cancellation."""

from __future__ import annotations

import asyncio
import struct
import zlib
from typing import Any

import numpy as np
import pytest

import afabric
from afabric import _native, errors, testing

from .conftest import WITH_CMA, libfabric_version, loop_name
from .procs import Ctl, Peer

MiB = 1 << 20
OP_TIMEOUT = 2.0


def pattern(nbytes: int, seed: int) -> np.ndarray:
    words = (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed)
    return words.view(np.uint8)


def reseal(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


def _access_at(blob: bytes) -> int:
    """Offset of an AFD2 descriptor's access field (after base, length, device, nics)."""
    assert blob[:4] == b"AFD2"
    return 8 + struct.unpack_from("<I", blob, 4)[0] + 8 + 8 + 4 + 4


def forge_access(blob: bytes, access: int) -> afabric.MrDesc:
    """The descriptor re-sealed claiming another access (what a forger would make)."""
    at = _access_at(blob)
    body = blob[:-4]
    return afabric.MrDesc.from_bytes(reseal(body[:at] + struct.pack("<I", access) + body[at + 4 :]))


def as_afd1(blob: bytes) -> afabric.MrDesc:
    """The same region as a descriptor from before reads (no access field) would name it."""
    at = _access_at(blob)
    body = blob[:-4]
    return afabric.MrDesc.from_bytes(reseal(b"AFD1" + body[4:at] + body[at + 4 :]))


RW = 0x1 | 0x4  # _native.MR_REMOTE | MR_REMOTE_READ


# ---- child processes ----


async def source(ctl: Ctl, provider: str, regions: list[tuple[int, int, Any]]) -> bool:
    """Registers one region per (nbytes, seed, remote), filled with pattern(nbytes, seed),
    publishes (descriptors, address) and answers commands: "changed" -> bytes per region
    that differ from the pattern; ("deregister", i) -> "revoked"; "stop"."""
    async with afabric.Engine(provider) as eng:
        bufs = [pattern(n, seed).copy() for n, seed, _ in regions]
        mrs = [eng.register(b, remote=remote) for b, (_, _, remote) in zip(bufs, regions, strict=True)]
        ctl.put(([bytes(m.descriptor) for m in mrs], bytes(eng.address)))
        while (cmd := await ctl.get()) != "stop":
            if cmd == "changed":
                diff = [b != pattern(n, s) for b, (n, s, _) in zip(bufs, regions, strict=True)]
                ctl.put([int(np.count_nonzero(d)) for d in diff])
            elif isinstance(cmd, tuple) and cmd[0] == "deregister":
                eng.deregister(mrs[cmd[1]])
                ctl.put("revoked")
            elif isinstance(cmd, tuple) and cmd[0] == "imm":
                await eng.write(eng.register(np.zeros(8, np.uint8), remote=False), afabric.MrDesc(cmd[1]), 0,
                                imm=cmd[2])  # fmt: skip
                ctl.put("sent")
        return True


async def start_source(peers: list[Peer], provider: str, regions: list[tuple[int, int, Any]]) -> tuple[
    Peer, list[afabric.MrDesc]
]:  # fmt: skip
    p, descs, _ = await start_source_at(peers, provider, regions)
    return p, descs


async def start_source_at(peers: list[Peer], provider: str, regions: list[tuple[int, int, Any]]) -> tuple[
    Peer, list[afabric.MrDesc], afabric.Address
]:  # fmt: skip
    p = Peer(source, provider, regions, loop=loop_name())
    peers.append(p)
    blobs, addr = await p.get()
    return p, [afabric.MrDesc.from_bytes(b) for b in blobs], afabric.Address.from_bytes(addr)


async def stop(p: Peer, untouched: int) -> None:
    """The source's regions are as it wrote them (a read never writes there), then stop."""
    p.put("changed")
    assert await p.get() == [0] * untouched
    p.put("stop")
    assert await p.result() is True


# ---- byte-exact reads ----


@pytest.mark.both_loops
@pytest.mark.parametrize("provider", WITH_CMA)
async def test_contiguous_reads_are_byte_exact(provider: str, peers: list[Peer]) -> None:
    if provider == "cma" and loop_name() != "asyncio":
        pytest.skip("cma: one variant is enough (the suite's time budget)")
    total, chunk = 64 * MiB, MiB
    p, (desc,) = await start_source(peers, provider, [(total, 7, "r")])
    assert desc.access == "r" and desc.length == total
    want = pattern(total, 7)
    async with afabric.Engine(provider, timing=True) as eng:
        dst = np.zeros(total, dtype=np.uint8)
        mr = eng.register(dst, remote=False)
        # 64 concurrent 1 MiB reads into reversed slots
        n = total // chunk
        await asyncio.gather(
            *(
                eng.read(mr, desc, chunk, src_offset=i * chunk, dst_offset=(n - 1 - i) * chunk)
                for i in range(n)
            )
        )
        assert np.array_equal(dst.reshape(n, chunk)[::-1].reshape(-1), want)
        # the whole region in one read (cut into work requests by the shim)
        dst[:] = 0
        await eng.read(mr, desc, total)
        assert np.array_equal(dst, want)
        # unaligned offsets and an odd length; bytes around the landing zone stay put
        dst[:] = 0xEE
        await eng.read(mr, desc, 12_345, src_offset=777, dst_offset=3)
        assert np.array_equal(dst[3 : 3 + 12_345], want[777 : 777 + 12_345])
        assert dst[2] == 0xEE and dst[3 + 12_345] == 0xEE
        await eng.read(mr, desc, 0, src_offset=total)  # zero bytes at the very end: nothing to do
        st = eng.stats()["nics"][0]
        assert st["reads"] >= n + 2 and st["read_bytes"] == 2 * total + 12_345
        assert st["writes"] == 0 and st["outstanding"] == 0
        kinds = {t.kind for t in eng.timings()}
        assert "read" in kinds, kinds
    await stop(p, 1)


@pytest.mark.both_loops
async def test_paged_reads_are_byte_exact(provider: str, peers: list[Peer]) -> None:
    npages, page_len = 10_000, 256
    p, (desc,) = await start_source(peers, provider, [(npages * page_len, 11, "rw")])
    assert desc.access == "rw"
    rng = np.random.default_rng(5)
    src_idx = rng.permutation(npages).astype(np.int64)
    dst_idx = rng.permutation(npages).astype(np.int64)
    async with afabric.Engine(provider, timing=True) as eng:
        # destination pages 512 B apart at offset 64: the gaps must stay untouched
        dst = np.full(npages * 512 + 64, 0xEE, dtype=np.uint8)
        mr = eng.register(dst)
        await eng.read_paged(
            mr, desc, page_len=page_len,
            src_pages=afabric.Pages(src_idx, page_len), dst_pages=afabric.Pages(dst_idx, 512, 64),
        )  # fmt: skip
        remote = pattern(npages * page_len, 11).reshape(npages, page_len)
        got = dst[64:].reshape(npages, 512)
        assert np.array_equal(got[dst_idx, :page_len], remote[src_idx])
        assert (got[:, page_len:] == 0xEE).all() and (dst[:64] == 0xEE).all()
        assert eng.stats()["nics"][0]["read_bytes"] == npages * page_len
        assert "paged read" in {t.kind for t in eng.timings()}
    await stop(p, 1)


@pytest.mark.both_loops
async def test_gather_from_three_peers_is_byte_exact(provider: str, peers: list[Peer]) -> None:
    size = MiB
    sources = [await start_source_at(peers, provider, [(size, 100 + k, "r")]) for k in range(3)]
    async with afabric.Engine(provider, timing=True) as eng:
        group = eng.peer_group([s[2] for s in sources])
        dst = np.zeros(12 * 65_536, dtype=np.uint8)
        mr = eng.register(dst, remote=False)
        # four 64 KiB pieces from each peer, interleaved into the destination
        plan = [(k, j) for j in range(4) for k in range(3)]
        srcs = [
            afabric.GatherSource(sources[k][1][0], 65_536, src_offset=j * 200_000 + k, dst_offset=i * 65_536)
            for i, (k, j) in enumerate(plan)
        ]
        await eng.gather(mr, srcs, group=group)
        for i, (k, j) in enumerate(plan):
            want = pattern(size, 100 + k)[j * 200_000 + k : j * 200_000 + k + 65_536]
            assert np.array_equal(dst[i * 65_536 : (i + 1) * 65_536], want), f"piece {i} (peer {k})"
        assert eng.stats()["nics"][0]["reads"] == len(plan)
        assert "gather" in {t.kind for t in eng.timings()}
    for p, _, _ in sources:
        await stop(p, 1)


async def test_gather_group_must_hold_every_source(provider: str, peers: list[Peer]) -> None:
    (pa, (da,), _), (pb, (db,), b_addr) = [
        await start_source_at(peers, provider, [(4096, k, "r")]) for k in (1, 2)
    ]
    async with afabric.Engine(provider) as eng:
        mr = eng.register(np.zeros(8192, np.uint8), remote=False)
        group = eng.peer_group([b_addr])
        with pytest.raises(errors.InvalidArgument, match="outside the peer group"):
            await eng.gather(mr, [afabric.GatherSource(db, 16), afabric.GatherSource(da, 16)], group=group)
        assert eng.stats()["nics"][0]["reads"] == 0
        await eng.gather(mr, [afabric.GatherSource(db, 16)], group=group)
    await stop(pa, 1)
    await stop(pb, 1)


# ---- bad input: a typed error, nothing posted ----


async def test_bad_reads_are_refused_before_posting(provider: str, peers: list[Peer]) -> None:
    p, (desc,) = await start_source(peers, provider, [(65_536, 3, "r")])
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        dst = np.full(4096, 0xEE, dtype=np.uint8)
        mr = eng.register(dst, remote=False)
        cases: list[tuple[type[BaseException], str, Any]] = [
            (errors.OutOfRange, "source", eng.read(mr, desc, 16, src_offset=65_536 - 8)),
            (errors.OutOfRange, "destination", eng.read(mr, desc, 16, dst_offset=4090)),
            (errors.OutOfRange, "destination", eng.read(mr, desc, 8192)),
            (errors.OutOfRange, "negative", eng.read(mr, desc, -1)),
            (errors.OutOfRange, "source", eng.read(mr, desc, 1, src_offset=2**64 - 1)),
            (errors.InvalidArgument, "integer", eng.read(mr, desc, 1.5)),  # type: ignore[arg-type]
            (errors.InvalidArgument, "MemoryRegion", eng.read(bytearray(8), desc, 8)),  # type: ignore[arg-type]
            (errors.InvalidArgument, "MrDesc", eng.read(mr, "desc", 8)),  # type: ignore[arg-type]
            (
                errors.OutOfRange,
                "source page",
                eng.read_paged(
                    mr,
                    desc,
                    page_len=256,
                    src_pages=afabric.Pages([0, 256], 256),
                    dst_pages=afabric.Pages([0, 1], 256),
                ),
            ),
            (
                errors.OutOfRange,
                "destination page",
                eng.read_paged(
                    mr,
                    desc,
                    page_len=256,
                    src_pages=afabric.Pages([0, 1], 256),
                    dst_pages=afabric.Pages([0, 16], 256),
                ),
            ),
            (
                errors.InvalidArgument,
                "pages",
                eng.read_paged(
                    mr,
                    desc,
                    page_len=256,
                    src_pages=afabric.Pages([0, 1], 256),
                    dst_pages=afabric.Pages([0], 256),
                ),
            ),
            (
                errors.OutOfRange,
                "gather source 1",
                eng.gather(
                    mr, [afabric.GatherSource(desc, 8), afabric.GatherSource(desc, 8, src_offset=65_535)]
                ),
            ),
            (
                errors.OutOfRange,
                "gather source 0",
                eng.gather(mr, [afabric.GatherSource(desc, 8, dst_offset=4095)]),
            ),
            (errors.InvalidArgument, "GatherSource", eng.gather(mr, [afabric.ScatterTarget(desc, 8)])),  # type: ignore[list-item]
        ]
        for cls, words, op in cases:
            with pytest.raises(cls, match=words):
                await op
        # a read-only buffer cannot be a destination
        ro = np.frombuffer(bytes(4096), dtype=np.uint8)
        ro_mr = eng.register(ro, remote=False)
        with pytest.raises(errors.InvalidArgument, match="read-only"):
            await eng.read(ro_mr, desc, 8)
        # a deregistered destination
        gone = eng.register(np.zeros(64, np.uint8), remote=False)
        eng.deregister(gone)
        with pytest.raises(errors.StaleRegion):
            await eng.read(gone, desc, 8)
        st = eng.stats()["nics"][0]
        assert st["reads"] == 0 and st["read_bytes"] == 0, st
        assert (dst == 0xEE).all()
        await eng.read(mr, desc, 4096)  # and the engine reads fine afterwards
        assert np.array_equal(dst, pattern(65_536, 3)[:4096])
    await stop(p, 1)


# ---- access: what the descriptor lets a peer do ----


async def test_access_is_checked_before_posting(provider: str, peers: list[Peer]) -> None:
    """A read of a region registered "w" and a write into one registered "r" raise
    RemoteKeyRejected before anything is posted; "rw" allows both."""
    p, (d_w, d_r, d_rw) = await start_source(
        peers, provider, [(4096, 1, "w"), (4096, 2, "r"), (4096, 3, "rw")]
    )
    assert (d_w.access, d_r.access, d_rw.access) == ("w", "r", "rw")
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        buf = np.full(4096, 0xEE, dtype=np.uint8)
        mr = eng.register(buf, remote=False)
        with pytest.raises(errors.RemoteKeyRejected, match=r'read refused before posting.*remote="w"'):
            await eng.read(mr, d_w, 8)
        with pytest.raises(errors.RemoteKeyRejected, match=r'write refused before posting.*remote="r"'):
            await eng.write(mr, d_r, 8)
        with pytest.raises(errors.RemoteKeyRejected, match=r"target 1"):
            await eng.gather(mr, [afabric.GatherSource(d_r, 8), afabric.GatherSource(d_w, 8)])
        with pytest.raises(errors.RemoteKeyRejected, match=r"target 0"):
            await eng.scatter(mr, [afabric.ScatterTarget(d_r, 8)])
        with pytest.raises(errors.RemoteKeyRejected):
            await eng.read_paged(
                mr, d_w, page_len=8, src_pages=afabric.Pages([0], 8), dst_pages=afabric.Pages([0], 8)
            )
        with pytest.raises(errors.RemoteKeyRejected):
            await eng.write_paged(
                mr, d_r, page_len=8, src_pages=afabric.Pages([0], 8), dst_pages=afabric.Pages([0], 8)
            )
        st = eng.stats()["nics"][0]
        assert st["reads"] == 0 and st["writes"] == 0, st
        assert (buf == 0xEE).all()
        await eng.read(mr, d_rw, 4096)
        assert np.array_equal(buf, pattern(4096, 3))
    p.put("changed")
    assert await p.get() == [0, 0, 0]
    # "rw" is writable: a write of its own bytes changes nothing the source checks
    async with afabric.Engine(provider) as eng:
        same = eng.register(pattern(4096, 3).copy(), remote=False)
        await eng.write(same, d_rw, 4096)
    await stop(p, 3)


def expect_refused(provider: str, seen: str) -> None:
    """How each provider reports a refused one-sided access (see test_access.py)."""
    if provider == "tcp":  # refused, or failed by the connection the refusal reset: 2.x's tcp
        # may close it before the refusal's completion arrives (docs/limitations.md)
        assert seen.startswith(("TransportError", "RemoteKeyRejected", "PeerUnreachable")), seen
    elif provider == "cma":  # the writer checks the target's export table itself
        assert seen.startswith("RemoteKeyRejected"), seen
    elif libfabric_version() < (2, 0):  # 1.17 shm drops it unanswered; the provider sees that
        assert seen.startswith("RemoteKeyRejected"), seen  # (its target's queue drained)


async def outcome(op: Any) -> str:
    try:
        await asyncio.wait_for(op, OP_TIMEOUT + 15)
    except errors.TransportError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_provider_refuses_a_write_into_a_read_only_region(provider: str, peers: list[Peer]) -> None:
    """A descriptor of an "r" region forged to say "rw" passes the initiator's check; the
    target's provider (registered without FI_REMOTE_WRITE) refuses the write."""
    p, (d_r,) = await start_source(peers, provider, [(65_536, 4, "r")])
    forged = forge_access(bytes(d_r), RW)
    assert forged.access == "rw"
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(np.full(65_536, 0xAB, dtype=np.uint8), remote=False)
        seen = await outcome(eng.write(src, forged, 65_536))
        print(f"\n{provider}: write into an 'r' region through a forged descriptor -> {seen}")
        expect_refused(provider, seen)
    await stop(p, 1)


def _read_access_enforced(provider: str) -> bool:
    """Measured: only libfabric 2.x tcp refuses a remote read the region was not registered
    for. 1.17's tcp;ofi_rxm registers every region FI_REMOTE_READ (its rendezvous reads);
    1.17's shm reads through CMA from the initiator without checking the key at all; 2.5.1's
    shm reports the refused read as a success (nothing read). docs/security.md. cma checks
    the target's export entry (its access bits) before every read."""
    return provider == "cma" or (provider == "tcp" and libfabric_version() >= (2, 0))


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_provider_refuses_a_read_of_a_write_only_region(
    provider: str, peers: list[Peer], request: Any
) -> None:
    if not _read_access_enforced(provider):
        request.applymarker(pytest.mark.xfail(strict=True, reason="provider does not enforce read access"))
    p, (d_w,) = await start_source(peers, provider, [(65_536, 5, "w")])
    forged = forge_access(bytes(d_w), RW)
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        dst = np.zeros(65_536, dtype=np.uint8)
        mr = eng.register(dst, remote=False)
        seen = await outcome(eng.read(mr, forged, 65_536))
        print(f"\n{provider}: read of a 'w' region through a forged descriptor -> {seen}, "
              f"{int(np.count_nonzero(dst))} bytes read")  # fmt: skip
        assert seen != "ok" and not dst.any(), "a write-only region was read"
    await stop(p, 1)


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_read_after_deregister_fails(provider: str, peers: list[Peer], request: Any) -> None:
    if provider not in ("tcp", "cma"):
        request.applymarker(
            pytest.mark.xfail(
                strict=True, reason="shm 1.17 reads revoked regions (CMA); 2.5.1 reports success"
            )
        )
    p, (desc, keep) = await start_source(peers, provider, [(65_536, 6, "r"), (4096, 9, "r")])
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        dst = np.zeros(65_536, dtype=np.uint8)
        mr = eng.register(dst, remote=False)
        await eng.read(mr, desc, 65_536)
        assert np.array_equal(dst, pattern(65_536, 6))
        p.put(("deregister", 0))
        assert await p.get() == "revoked"
        dst[:] = 0
        seen = await outcome(eng.read(mr, desc, 65_536))
        print(
            f"\n{provider}: read of a deregistered region -> {seen}, {int(np.count_nonzero(dst))} bytes read"
        )
        assert seen != "ok" and not dst.any(), "a deregistered region was read"
        # the other region still reads (tcp;ofi_rxm 1.17 resets the connection after a refusal)
        for _ in range(5):
            try:
                await eng.read(mr, keep, 4096)
                break
            except errors.PeerUnreachable:
                await asyncio.sleep(0.1)
        assert np.array_equal(dst[:4096], pattern(4096, 9))
    p.put("stop")
    assert await p.result() is True


# ---- registration and descriptors ----


async def test_register_access_values() -> None:
    async with afabric.Engine("tcp") as eng:
        buf = np.zeros(4096, np.uint8)
        for remote, access in ((True, "w"), ("w", "w"), ("r", "r"), ("rw", "rw"), ("wr", "rw")):
            mr = eng.register(buf, remote=remote)
            assert mr.access == access and mr.remote and mr.descriptor.access == access
            assert f"remote={access!r}" in repr(mr)
            eng.deregister(mr)
        mr = eng.register(buf, remote=False)
        assert mr.access == "" and not mr.remote
        with pytest.raises(errors.UsageError):
            _ = mr.descriptor
        for bad in ("x", "", 1, None, "ww"):
            with pytest.raises(errors.InvalidArgument, match="remote must be"):
                eng.register(buf, remote=bad)  # type: ignore[arg-type]
        # read-only memory: readable by peers, never writable by them
        ro = np.frombuffer(bytes(range(256)) * 16, dtype=np.uint8)
        assert eng.register(ro, remote="r").readonly
        for remote in (True, "w", "rw"):
            with pytest.raises(errors.RegistrationError, match="read-only"):
                eng.register(ro, remote=remote)
        ptr_mr = eng.register_ptr(buf.ctypes.data, 4096, remote="r", owner=buf)
        assert ptr_mr.descriptor.access == "r"


async def test_descriptors_from_before_reads_still_work() -> None:
    """An AFD1 descriptor (no access field) decodes with access "" and is not checked by the
    initiator: writes and reads go to the provider as they did."""
    async with afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        src = pattern(4096, 8).copy()
        rmr = b.register(src, remote="rw")
        old = as_afd1(bytes(rmr.descriptor))
        assert old.access == "" and old.length == 4096 and bytes(old)[:4] == b"AFD1"
        dst = np.zeros(4096, np.uint8)
        lmr = a.register(dst, remote=False)
        await a.read(lmr, old, 4096)
        assert np.array_equal(dst, src)
        await a.write(lmr, old, 16, dst_offset=8)
        assert np.array_equal(src[8:24], dst[:16])  # src's first 16 bytes, written 8 further
        # a bad access value is a malformed descriptor
        for bad in (0, 0x2, 0x8):
            with pytest.raises(errors.BadDescriptor, match="access"):
                forge_access(bytes(rmr.descriptor), bad)


# ---- deadlines, triggers, cancellation ----


async def silent(ctl: Ctl, provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        mr = eng.register(np.zeros(MiB, np.uint8), remote="r")
        ctl.put(bytes(mr.descriptor))
        await asyncio.sleep(3600)


async def test_read_from_a_killed_peer_fails_in_bounded_time(
    provider: str, peers: list[Peer], shm_cleanup: None
) -> None:
    victim = Peer(silent, provider)
    peers.append(victim)
    desc = afabric.MrDesc.from_bytes(await victim.get())
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        mr = eng.register(np.zeros(MiB, np.uint8), remote=False)
        await eng.read(mr, desc, MiB)
        victim.kill()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(errors.TransportError):
            for _ in range(100):  # reads may still complete from buffers for a moment
                await asyncio.wait_for(eng.read(mr, desc, MiB), 30)
        assert loop.time() - t0 < OP_TIMEOUT + 10


async def test_triggered_read_fires_on_an_immediate_and_cancels(provider: str, peers: list[Peer]) -> None:
    p, (desc,) = await start_source(peers, provider, [(4096, 12, "r")])
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        dst = np.zeros(4096, np.uint8)
        mr = eng.register(dst)
        imm = eng.alloc_imm()
        # armed: cancelled before its condition holds, nothing read
        armed = asyncio.ensure_future(eng.read(mr, desc, 4096, when=afabric.imm_count(imm, 1)))
        await asyncio.sleep(0.05)
        armed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await armed
        assert not dst.any() and eng.stats()["nics"][0]["reads"] == 0
        # fired by the peer's immediate, with no Python in between
        fired = asyncio.ensure_future(eng.read(mr, desc, 4096, when=afabric.imm_count(imm, 1)))
        await asyncio.sleep(0.05)
        assert not fired.done()
        p.put(("imm", bytes(mr.descriptor), imm))
        assert await p.get() == "sent"
        await asyncio.wait_for(fired, 30)
        assert np.array_equal(dst, pattern(4096, 12))
    await stop(p, 1)


# ---- the EFA code paths (FI_MR_LOCAL, provider keys) on software providers ----


async def efa_source(ctl: Ctl, provider: str) -> bool:
    with testing.force_efa_modes():
        eng = afabric.Engine(provider)
    async with eng:
        buf = pattern(4 * MiB, 31).copy()
        mr = eng.register(buf, remote="r")
        ctl.put(bytes(mr.descriptor))
        assert await ctl.get() == "stop"
        return bool(np.array_equal(buf, pattern(4 * MiB, 31)))


async def test_reads_with_efa_modes_forced(provider: str, peers: list[Peer]) -> None:
    """Reads with local descriptors required (FI_MR_LOCAL) and emulated provider keys, as
    EFA asks: contiguous (several work requests) and paged, byte-exact."""
    p = Peer(efa_source, provider)
    peers.append(p)
    desc = afabric.MrDesc.from_bytes(await p.get())
    with testing.force_efa_modes():
        eng = afabric.Engine(provider)
    async with eng:
        assert eng.caps & _native.CAP_MR_LOCAL and eng.caps & _native.CAP_PROV_KEY
        dst = np.zeros(4 * MiB, np.uint8)
        mr = eng.register(dst, remote=False)
        await asyncio.gather(
            *(eng.read(mr, desc, MiB, src_offset=i * MiB, dst_offset=i * MiB) for i in range(4))
        )
        assert np.array_equal(dst, pattern(4 * MiB, 31))
        dst[:] = 0
        perm = np.random.default_rng(2).permutation(1024).astype(np.int64)
        await eng.read_paged(
            mr,
            desc,
            page_len=4096,
            src_pages=afabric.Pages(perm, 4096),
            dst_pages=afabric.Pages(np.arange(1024), 4096),
        )
        assert np.array_equal(dst.reshape(1024, 4096), pattern(4 * MiB, 31).reshape(1024, 4096)[perm])
    p.put("stop")
    assert await p.result() is True


# ---- domain groups of two NICs: reads shard and spread as writes do ----

TWO_NICS = {"tcp": ["lo", "lo"], "shm": ["shm", "shm"]}


async def two_nic_source(ctl: Ctl, provider: str, nbytes: int) -> bool:
    async with afabric.Engine(provider, nics=TWO_NICS[provider]) as eng:
        buf = pattern(nbytes, 41).copy()
        mr = eng.register(buf, remote="r")
        ctl.put(bytes(mr.descriptor))
        assert await ctl.get() == "stop"
        return bool(np.array_equal(buf, pattern(nbytes, 41)))


async def test_reads_over_a_two_nic_group(provider: str, peers: list[Peer]) -> None:
    """A contiguous read of 8 MiB is sharded over both NICs, pages and gather sources take
    turns: byte-exact, and both NICs carried reads."""
    nbytes = 16 * MiB
    p = Peer(two_nic_source, provider, nbytes)
    peers.append(p)
    desc = afabric.MrDesc.from_bytes(await p.get())
    assert desc.nics == 2 and desc.access == "r"
    async with afabric.Engine(provider, nics=TWO_NICS[provider]) as eng:
        dst = np.zeros(nbytes, np.uint8)
        mr = eng.register(dst, remote=False)
        half = nbytes // 2
        await asyncio.gather(
            eng.read(mr, desc, half), eng.read(mr, desc, half, src_offset=half, dst_offset=half)
        )
        assert np.array_equal(dst, pattern(nbytes, 41))
        per_nic = [n["read_bytes"] for n in eng.stats()["nics"]]
        assert all(b > 0 for b in per_nic) and sum(per_nic) == nbytes, per_nic
        dst[:] = 0
        npages = 256
        perm = np.random.default_rng(6).permutation(npages).astype(np.int64)
        await eng.read_paged(
            mr,
            desc,
            page_len=4096,
            src_pages=afabric.Pages(perm, 4096),
            dst_pages=afabric.Pages(np.arange(npages), 4096),
        )
        got = dst[: npages * 4096].reshape(npages, 4096)
        assert np.array_equal(got, pattern(nbytes, 41)[: npages * 4096].reshape(npages, 4096)[perm])
        await eng.gather(
            mr, [afabric.GatherSource(desc, 4096, src_offset=k * 4096, dst_offset=k * 4096) for k in range(8)]
        )
        assert np.array_equal(dst[: 8 * 4096], pattern(nbytes, 41)[: 8 * 4096])
        assert sum(n["reads"] for n in eng.stats()["nics"]) >= 2 * 2 + npages + 8  # 2+ work requests each
    p.put("stop")
    assert await p.result() is True


# ---- a provider library from before reads (ABI minor 3, no post_reads) ----

_MINOR3_SHIM = r"""
/* The first-party ofi table as a minor-3 library would export it: cut before post_reads. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include "afabric_provider.h"

static struct afp_ops cut; /* a test helper: one table for the process */

__attribute__((visibility("default"))) const struct afp_ops *afp_get_ops(void)
{
    void *h = dlopen(getenv("AFABRIC_TEST_REAL_OFI"), RTLD_NOW | RTLD_LOCAL);
    afp_get_ops_fn get = h ? (afp_get_ops_fn)dlsym(h, "afp_get_ops") : NULL;
    if (!get)
        return NULL;
    memcpy(&cut, get(), offsetof(struct afp_ops, post_reads));
    cut.size = (uint32_t)offsetof(struct afp_ops, post_reads);
    cut.minor = 3;
    return &cut;
}
"""

_MINOR3_CHECK = """
import asyncio, numpy as np, afabric
from afabric import errors, registry
tcp = next(a for a in registry.probe_all() if a.name == "tcp")  # its table ends in `reserved`
assert tcp.nics and all(n.lib_version == "" for n in tcp.nics), tcp.nics
async def main():
    async with afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        w = b.register(np.zeros(4096, np.uint8))                  # writes still work
        src = a.register(np.full(4096, 7, np.uint8), remote=False)
        await a.write(src, w.descriptor, 4096)
        assert (w.buffer == 7).all()
        try:
            b.register(np.zeros(64, np.uint8), remote="r")
            raise SystemExit("a readable region registered without post_reads")
        except errors.RegistrationError as e:
            print("register r:", e)
        try:
            await a.read(src, w.descriptor, 8)
            raise SystemExit("a read posted without post_reads")
        except errors.Unsupported as e:
            print("read:", e)
asyncio.run(main())
print("ok")
"""


def run_on_a_minor3_provider(tmp_path: Any, script: str) -> str:
    """Builds a provider library whose ops table ends before post_reads (ABI minor 3: it
    forwards to the real ofi library) and runs `script` in a child process on it; returns
    the child's stdout, which must end with "ok"."""
    import os
    import subprocess
    import sys

    import afabric_ofi
    import build_native as bn

    try:
        cc = list(bn.compiler())
    except bn.BuildError as e:
        pytest.skip(str(e))
    src = tmp_path / "minor3.c"
    src.write_text(_MINOR3_SHIM)
    lib = tmp_path / "libminor3.so"
    cmd = [*cc, "-std=c11", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra", "-Werror",
           f"-I{bn.SHIM_DIR}", str(src), "-o", str(lib), "-ldl"]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert built.returncode == 0, built.stderr
    env = dict(os.environ, AFABRIC_OFI_LIB=str(lib), AFABRIC_TEST_REAL_OFI=afabric_ofi.library_path())
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120, check=False)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
    return proc.stdout


def test_a_provider_without_post_reads_keeps_working(tmp_path: Any) -> None:
    """The provider ABI grows by minor versions: a library whose table ends before
    post_reads still serves writes; reads and readable regions are refused before the shim
    calls it (Unsupported / RegistrationError), never a NULL call; and its NICs report no
    library version (afp_nic_info.lib_version is minor 7's, read as 0 before)."""
    out = run_on_a_minor3_provider(tmp_path, _MINOR3_CHECK)
    assert "no one-sided reads" in out and "has no reads" in out, out
