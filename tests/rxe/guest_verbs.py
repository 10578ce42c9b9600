"""The verbs provider between real processes on Soft-RoCE: runs INSIDE the qemu guest.

Collected only through tests/test_verbs.py, which boots the guest (tests/rxe/guest.py) and
runs ``python -m pytest tests/rxe/guest_verbs.py`` there (the file name keeps the host's
pytest from collecting it). Python is 25-50x slower in the guest, so one server process
with two engines serves most tests (spawning a process costs seconds there), and sizes are
small; everything is still checked byte by byte.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import afabric
from afabric import errors

from ..procs import Ctl, Peer

pytestmark = pytest.mark.skipif(
    os.environ.get("AFABRIC_IN_RXE_GUEST") != "1", reason="runs inside the Soft-RoCE guest only"
)

P = "verbs"
REGION = 4 << 20
PAGE = 4096
NPAGES = 512
BARRIER_IMM = 0xBA5E


def pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def pages(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(NPAGES).astype(np.int64), rng.permutation(NPAGES).astype(np.int64)


async def server(ctl: Ctl) -> str:  # noqa: PLR0915 - one branch per request kind
    """Two engines (a scatter needs two targets); answers the test's requests in turn."""
    async with afabric.Engine(P) as e1, afabric.Engine(P) as e2:
        b1, b2 = np.zeros(REGION, np.uint8), np.zeros(REGION, np.uint8)
        m1, m2 = e1.register(b1), e2.register(b2)
        imm = e1.alloc_imm()
        ctl.put((bytes(e1.address), bytes(e2.address), bytes(m1.descriptor), bytes(m2.descriptor), imm))
        readable: list[tuple[np.ndarray, bytes]] = []
        while True:
            req = await ctl.get(timeout=300)
            kind = req[0]
            if kind == "quit":
                return "bye"
            if kind == "contig":  # one write of n bytes at offset off, then its immediate
                _, n, off, seed = req
                await e1.expect_imm(imm, 1, timeout=60)
                ok = np.array_equal(b1[off : off + n], pattern(n, seed))
                ctl.put(ok and not b1[:off].any() and not b1[off + n :].any())
            elif kind == "paged":
                _, seed = req
                await e1.expect_imm(imm, NPAGES, timeout=60)
                src_idx, dst_idx = pages(seed)
                src = pattern(NPAGES * PAGE, seed).reshape(NPAGES, PAGE)
                ctl.put(bool(np.array_equal(b1.reshape(-1, PAGE)[dst_idx], src[src_idx])))
            elif kind == "early":  # every arrival is already counted when we ask
                _, n = req
                await e1.expect_imm(imm, n, timeout=30)
                try:
                    await e1.expect_imm(imm, 1, timeout=0.5)
                    ctl.put("an arrival was counted twice")
                except errors.OperationTimeout:
                    ctl.put("ok")
            elif kind == "echo":
                _, rounds = req
                for _ in range(rounds):
                    msg = await e1.recv_bytes()
                    n = int.from_bytes(msg[:2], "little")
                    await e1.send(afabric.Address.from_bytes(msg[2 : 2 + n]), msg[2 + n :][::-1])
                ctl.put("ok")
            elif kind == "scatter":
                _, n, seed = req
                await asyncio.gather(e1.expect_imm(imm, 1, timeout=60), e2.expect_imm(imm, 1, timeout=60))
                src = pattern(2 * n, seed)
                ok = np.array_equal(b1[:n], src[:n]) and np.array_equal(b2[n : 2 * n], src[n:])
                await asyncio.gather(
                    e1.expect_imm(BARRIER_IMM, 1, timeout=60), e2.expect_imm(BARRIER_IMM, 1, timeout=60)
                )
                ctl.put(bool(ok))
            elif kind == "clear":
                b1[:] = 0
                b2[:] = 0
                ctl.put("ok")
            elif kind == "readable":
                ctl.put(readable_regions(e1, e2, readable))
            elif kind == "vanish":
                ctl.put(await closed_engine_address())


async def closed_engine_address() -> bytes:
    """A third engine's address, once that engine is closed: a peer that never answers."""
    async with afabric.Engine(P) as e3:
        return bytes(e3.address)


def readable_regions(
    e1: afabric.Engine, e2: afabric.Engine, kept: list[tuple[np.ndarray, bytes]]
) -> tuple[list[bytes], list[int]]:
    """Regions to read from, registered once: "r" on e1 and on e2, "w" on e1; their
    descriptors, and how many bytes of each differ from what was put there."""
    if not kept:
        w1 = np.zeros(8192, np.uint8)
        for eng, buf, remote in (
            (e1, pattern(REGION, 21), "r"),
            (e2, pattern(REGION, 22), "r"),
            (e1, w1, "w"),
        ):
            kept.append((buf, bytes(eng.register(buf, remote=remote).descriptor)))
    wants = [pattern(REGION, 21), pattern(REGION, 22), np.zeros(8192, np.uint8)]
    return [d for _, d in kept], [
        int(np.count_nonzero(b != w)) for (b, _), w in zip(kept, wants, strict=True)
    ]


@pytest.fixture(scope="module")
def srv() -> Iterator[tuple[Peer, Any]]:
    p = Peer(server)
    info = asyncio.run(p.get(timeout=120))
    yield p, info
    p.put(("quit",))
    asyncio.run(p.result(timeout=60))
    p.close()


async def clear(p: Peer) -> None:
    p.put(("clear",))
    assert await p.get() == "ok"


async def test_contiguous_write_with_immediate(srv: tuple[Peer, Any]) -> None:
    p, (_a1, _a2, d1, _d2, imm) = srv
    await clear(p)
    n, off = (3 << 20) + 12345, 4097
    async with afabric.Engine(P) as eng:
        src = pattern(n, 11)
        mr = eng.register(src)
        p.put(("contig", n, off, 11))
        await eng.write(mr, afabric.MrDesc.from_bytes(d1), n, dst_offset=off, imm=imm)
        assert await p.get() is True
        nic = eng.stats()["nics"][0]
        assert nic["errors"] == 0


async def test_paged_write_with_immediates(srv: tuple[Peer, Any]) -> None:
    p, (_a1, _a2, d1, _d2, imm) = srv
    await clear(p)
    async with afabric.Engine(P) as eng:
        src = pattern(NPAGES * PAGE, 5)
        mr = eng.register(src)
        src_idx, dst_idx = pages(5)
        p.put(("paged", 5))
        await eng.write_paged(
            mr,
            afabric.MrDesc.from_bytes(d1),
            page_len=PAGE,
            src_pages=afabric.Pages(src_idx, PAGE),
            dst_pages=afabric.Pages(dst_idx, PAGE),
            imm=imm,
        )
        assert await p.get() is True


async def test_send_recv(srv: tuple[Peer, Any]) -> None:
    p, (a1, *_rest) = srv
    async with afabric.Engine(P) as eng:
        p.put(("echo", 3))
        me = bytes(eng.address)
        for body in (b"", b"x" * 100, bytes(range(256)) * 15):
            await eng.send(afabric.Address.from_bytes(a1), len(me).to_bytes(2, "little") + me + body)
            assert await eng.recv_bytes() == body[::-1]
        assert await p.get() == "ok"


async def test_early_arrivals_are_kept(srv: tuple[Peer, Any]) -> None:
    p, (_a1, _a2, d1, _d2, imm) = srv
    n = 50
    async with afabric.Engine(P) as eng:
        mr = eng.register(np.ones(64, np.uint8))
        desc = afabric.MrDesc.from_bytes(d1)
        await asyncio.gather(*(eng.write(mr, desc, 64, imm=imm) for _ in range(n)))
        p.put(("early", n))  # only now does the server ask for them
        assert await p.get() == "ok"


async def test_scatter_and_barrier(srv: tuple[Peer, Any]) -> None:
    p, (a1, a2, d1, d2, imm) = srv
    await clear(p)
    n = 256 << 10
    async with afabric.Engine(P) as eng:
        src = pattern(2 * n, 9)
        mr = eng.register(src)
        group = eng.peer_group([afabric.Address.from_bytes(a1), afabric.Address.from_bytes(a2)])
        desc1, desc2 = afabric.MrDesc.from_bytes(d1), afabric.MrDesc.from_bytes(d2)
        p.put(("scatter", n, 9))
        targets = [
            afabric.ScatterTarget(desc1, n, src_offset=0, dst_offset=0),
            afabric.ScatterTarget(desc2, n, src_offset=n, dst_offset=n),
        ]
        await eng.scatter(mr, targets, group=group, imm=imm)
        await eng.barrier([desc1, desc2], BARRIER_IMM, group=group)
        assert await p.get() is True


async def test_peer_that_starts_late(srv: tuple[Peer, Any]) -> None:
    """The handshake starts while the peer is stopped (its worker cannot answer): the
    datagrams are retransmitted and the write completes once it runs again."""
    p, (_a1, _a2, d1, _d2, imm) = srv
    await clear(p)
    assert p.proc.pid is not None
    async with afabric.Engine(P) as eng:
        src = pattern(8192, 3)
        mr = eng.register(src)
        p.put(("contig", 8192, 0, 3))
        os.kill(p.proc.pid, signal.SIGSTOP)
        try:
            task = asyncio.ensure_future(eng.write(mr, afabric.MrDesc.from_bytes(d1), 8192, imm=imm))
            await asyncio.sleep(1.5)
            assert not task.done(), "write completed while the peer was stopped"
        finally:
            os.kill(p.proc.pid, signal.SIGCONT)
        await asyncio.wait_for(task, 30)
        assert await p.get() is True


async def test_peer_that_never_answers_fails_in_bounded_time(
    srv: tuple[Peer, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server opens a third engine and closes it before sending its address: a peer
    that will never answer, in a process that lives on (one that exited is refused at once:
    shim/peers.c). (Its own process, spawned for this, cost the guest ~10 s.)"""
    p, _info = srv
    p.put(("vanish",))
    addr = afabric.Address.from_bytes(await p.get(timeout=60))
    monkeypatch.setenv("AFABRIC_VERBS_CONNECT_TIMEOUT_MS", "1500")
    async with afabric.Engine(P) as eng:
        t0 = time.monotonic()
        with pytest.raises(errors.OperationTimeout, match="no handshake answer"):
            await eng.send(addr, b"anyone?")
        dt = time.monotonic() - t0
        assert 1.2 < dt < 15, dt


async def test_out_of_region_write_rejected_before_posting(srv: tuple[Peer, Any]) -> None:
    _p, (_a1, _a2, d1, _d2, imm) = srv
    async with afabric.Engine(P) as eng:
        mr = eng.register(np.zeros(8192, np.uint8))
        desc = afabric.MrDesc.from_bytes(d1)
        with pytest.raises(errors.OutOfRange):
            await eng.write(mr, desc, 8192, dst_offset=REGION - 4096, imm=imm)
        with pytest.raises(errors.OutOfRange):
            await eng.write(mr, desc, 8193)  # beyond the local region
        assert eng.stats()["nics"][0]["writes"] == 0, "something was posted"


async def test_allow_list_names_senders_by_queue_pair() -> None:
    """An RC queue pair is connected to one peer, so the provider names every sender: the
    allow-list delivers the listed engine's messages and immediates and drops (counts as
    rejected, none as unknown) those of an engine that connected unasked."""
    async with afabric.Engine(P) as rx, afabric.Engine(P) as a, afabric.Engine(P) as b:
        desc = rx.register(np.zeros(64, np.uint8)).descriptor
        ma = a.register(np.ones(8, np.uint8), remote=False)
        mb = b.register(np.ones(8, np.uint8), remote=False)
        rx.allow_peers([a.address])
        await asyncio.gather(*(b.send(rx.address, b"b") for _ in range(5)))
        await asyncio.gather(*(b.write(mb, desc, 8, imm=9) for _ in range(5)))
        await asyncio.gather(*(a.send(rx.address, b"a") for _ in range(3)))
        await asyncio.gather(*(a.write(ma, desc, 8, imm=7) for _ in range(3)))
        assert [await asyncio.wait_for(rx.recv_bytes(), 30) for _ in range(3)] == [b"a"] * 3
        await rx.expect_imm(7, 3, timeout=30)
        nic = rx.stats()["nics"][0]
        for _ in range(600):  # b's were sent first, but may be polled later
            if nic["rejected"] >= 10:
                break
            await asyncio.sleep(0.05)
            nic = rx.stats()["nics"][0]
        assert (nic["rejected"], nic["rejected_unknown"], nic["recvs"]) == (10, 0, 3)
        with pytest.raises(errors.OperationTimeout):
            await rx.expect_imm(9, 1, timeout=0.5)


# ---- one-sided reads ----


async def readable(p: Peer) -> tuple[list[afabric.MrDesc], list[int]]:
    """Descriptors of the server's readable regions ("r" on e1, "r" on e2, "w" on e1) and
    how many bytes of each differ from what it put there."""
    p.put(("readable",))
    blobs, changed = await p.get()
    return [afabric.MrDesc.from_bytes(b) for b in blobs], changed


async def test_reads_contiguous_paged_and_gather(srv: tuple[Peer, Any]) -> None:
    p, (a1, a2, *_rest) = srv
    (r1, r2, _w1), changed = await readable(p)
    assert (r1.access, r2.access) == ("r", "r") and changed == [0, 0, 0]
    want1, want2 = pattern(REGION, 21), pattern(REGION, 22)
    async with afabric.Engine(P) as eng:
        dst = np.zeros(REGION, np.uint8)
        mr = eng.register(dst, remote=False)
        n, off = (3 << 20) + 12345, 4097
        await eng.read(mr, r1, n, src_offset=off, dst_offset=5)
        assert np.array_equal(dst[5 : 5 + n], want1[off : off + n]) and not dst[:5].any()
        dst[:] = 0
        src_idx, dst_idx = pages(13)
        await eng.read_paged(
            mr,
            r1,
            page_len=PAGE,
            src_pages=afabric.Pages(src_idx, PAGE),
            dst_pages=afabric.Pages(dst_idx, PAGE),
        )
        got, src = dst.reshape(-1, PAGE), want1.reshape(-1, PAGE)
        assert np.array_equal(got[dst_idx], src[src_idx])
        dst[:] = 0
        group = eng.peer_group([afabric.Address.from_bytes(a1), afabric.Address.from_bytes(a2)])
        k = 256 << 10
        await eng.gather(
            mr,
            [
                afabric.GatherSource(r2, k, src_offset=k, dst_offset=0),
                afabric.GatherSource(r1, k, dst_offset=k),
            ],
            group=group,
        )
        assert np.array_equal(dst[:k], want2[k : 2 * k]) and np.array_equal(dst[k : 2 * k], want1[:k])
        nic = eng.stats()["nics"][0]
        assert nic["errors"] == 0 and nic["writes"] == 0 and nic["reads"] >= 2 + NPAGES
    assert (await readable(p))[1] == [0, 0, 0]


async def test_read_access_enforced_by_the_device(srv: tuple[Peer, Any]) -> None:
    """The initiator refuses a read of a "w" region before posting; a descriptor forged to
    say "rw" gets past that, and the responder (rxe, registered without
    IBV_ACCESS_REMOTE_READ) refuses the READ: RemoteKeyRejected, nothing read. Likewise a
    write into an "r" region."""
    import struct
    import zlib

    def forge(d: afabric.MrDesc) -> afabric.MrDesc:
        blob = bytes(d)
        at = 8 + struct.unpack_from("<I", blob, 4)[0] + 24
        body = blob[:at] + struct.pack("<I", 0x5) + blob[at + 4 : -4]
        return afabric.MrDesc.from_bytes(body + struct.pack("<I", zlib.crc32(body)))

    p, _info = srv
    (r1, _r2, w1), _ = await readable(p)
    async with afabric.Engine(P) as eng:
        dst = np.zeros(8192, np.uint8)
        mr = eng.register(dst, remote=False)
        with pytest.raises(errors.RemoteKeyRejected, match="before posting"):
            await eng.read(mr, w1, 8192)
        assert eng.stats()["nics"][0]["reads"] == 0
        with pytest.raises(errors.RemoteKeyRejected):
            await asyncio.wait_for(eng.read(mr, forge(w1), 8192), 60)
        assert not dst.any()
    async with afabric.Engine(P) as eng:
        src = eng.register(np.full(8192, 0xAB, np.uint8), remote=False)
        with pytest.raises(errors.RemoteKeyRejected):
            await asyncio.wait_for(eng.write(src, forge(r1), 8192), 60)
    assert (await readable(p))[1] == [0, 0, 0]


async def test_killed_peer_reported_down_and_its_writes_fail_at_once() -> None:
    """Peer-down on verbs (shim/peers.c, provider-neutral): a same-host peer SIGKILLed with
    writes in flight is reported down and every write to it fails with PeerUnreachable well
    before op_timeout (20 s); a new one is refused before posting. (Measured in the guest,
    TCG: event 23 ms, writes settled 72 ms after the kill.)"""
    from ..faults import victim_target

    v = Peer(victim_target, P, REGION)
    try:
        desc_b, _addr, pid = await v.get(timeout=120)
        desc = afabric.MrDesc.from_bytes(desc_b)
        async with afabric.Engine(P, op_timeout=20) as eng:
            mr = eng.register(np.ones(65536, np.uint8))
            await eng.write(mr, desc, 65536)
            events = eng.peer_events()
            up = await asyncio.wait_for(events.__anext__(), 10)
            assert (up.kind, up.pid, up.watched) == ("up", pid, True)
            writes = [asyncio.ensure_future(eng.write(mr, desc, 65536)) for _ in range(8)]
            v.kill()
            t0 = time.monotonic()
            down = await asyncio.wait_for(events.__anext__(), 10)
            assert (down.kind, down.reason) == ("down", "exited")
            results = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 10)
            took = time.monotonic() - t0
            failed = [r for r in results if isinstance(r, BaseException)]
            assert all(isinstance(r, errors.PeerUnreachable) for r in failed), failed
            assert took < 5, took  # the guest is 25-50x slower than the host; op_timeout is 20 s
            with pytest.raises(errors.PeerUnreachable, match="exited"):
                await eng.write(mr, desc, 8)
    finally:
        v.close()
