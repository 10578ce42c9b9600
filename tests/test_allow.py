"""The allow-list between real processes: a listed peer's messages and immediates arrive, an
unlisted peer's are dropped in the shim and counted (a flood of them never reaches Python)
while listed traffic flows on, changes take effect at once, what has no known sender is
refused unless accepted explicitly, and the engine itself reaches no unlisted peer. The one
thing a list cannot stop, a one-sided write by a peer holding a key, is shown landing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import afabric
from afabric import errors

from .procs import Ctl, Peer

IMM_A, IMM_B = 7, 9


async def sender(ctl: Ctl, provider: str) -> bool:
    """A peer that sends tagged messages and immediate-carrying writes on command."""
    async with afabric.Engine(provider) as eng:
        src = np.arange(64, dtype=np.uint8)
        mr = eng.register(src, remote=False)
        ctl.put(bytes(eng.address))
        while True:
            cmd = await ctl.get()
            if cmd[0] == "stop":
                return True
            _, target_b, desc_b, tag, n_msgs, imm, n_imms, length = cmd
            target = afabric.Address.from_bytes(target_b)
            desc = afabric.MrDesc.from_bytes(desc_b)
            await asyncio.gather(*(eng.send(target, b"%s %d" % (tag, i)) for i in range(n_msgs)))
            await asyncio.gather(*(eng.write(mr, desc, length, imm=imm) for _ in range(n_imms)))
            ctl.put("sent")


async def start_senders(peers: list[Peer], provider: str, n: int) -> list[tuple[Peer, afabric.Address]]:
    out = []
    for _ in range(n):
        p = Peer(sender, provider)
        peers.append(p)
        out.append(p)
    return [(p, afabric.Address.from_bytes(await p.get())) for p in out]


async def burst(
    p: Peer, eng: afabric.Engine, mr: Any, tag: bytes, n_msgs: int, imm: int, n_imms: int, length: int = 0
) -> None:
    p.put(("burst", bytes(eng.address), bytes(mr.descriptor), tag, n_msgs, imm, n_imms, length))
    assert await p.get() == "sent"


async def counters_reach(eng: afabric.Engine, want: dict[str, int], timeout: float = 20.0) -> dict[str, int]:
    """The first NIC's counters once every `want` counter is at least its value (the
    sender's completion can come before the target's worker polled the arrival)."""
    deadline = time.monotonic() + timeout
    while True:
        nic: dict[str, int] = eng.stats()["nics"][0]
        if all(nic[k] >= v for k, v in want.items()) or time.monotonic() > deadline:
            return nic
        await asyncio.sleep(0.02)


async def drain_messages(eng: afabric.Engine, n: int) -> list[bytes]:
    return [await asyncio.wait_for(eng.recv_bytes(), 20) for _ in range(n)]


async def nothing_more(eng: afabric.Engine) -> None:
    """No further message reaches Python (a short wait; a dropped one never will)."""
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(eng.recv_bytes(), 0.5)


def exact_imm_sources(eng: afabric.Engine) -> bool:
    """shm and libfabric 2's native tcp name the sender of every immediate, 1.17's
    tcp;ofi_rxm of none (docs/security.md)."""
    return "ofi_rxm" not in eng.fabric_provider


async def test_listed_peer_delivers_unlisted_flood_is_dropped(provider: str, peers: list[Peer]) -> None:
    (a, addr_a), (b, _addr_b) = await start_senders(peers, provider, 2)
    async with afabric.Engine(provider, allow_peers=[addr_a]) as eng:
        assert eng.allowed_peers == (addr_a,)
        buf = np.zeros(64, dtype=np.uint8)
        mr = eng.register(buf)
        flood = 600
        # the unlisted peer floods messages (and immediates) while the listed one talks
        flood_task = asyncio.ensure_future(burst(b, eng, mr, b"B", flood, IMM_B, 50))
        await burst(a, eng, mr, b"A", 40, IMM_A, 30)
        await flood_task
        got = await drain_messages(eng, 40)
        assert sorted(got) == sorted(b"A %d" % i for i in range(40))
        exact = exact_imm_sources(eng)
        unknown_imms = 0 if exact else 50 + 30
        want = {"rejected": flood + (50 if exact else 0), "rejected_unknown": unknown_imms}
        nic = await counters_reach(eng, want)
        await nothing_more(eng)
        assert nic["recvs"] == 40  # only the listed peer's messages were delivered
        if exact_imm_sources(eng):
            assert nic["rejected"] == flood + 50  # B's messages and immediates
            assert nic["rejected_unknown"] == 0
            await eng.expect_imm(IMM_A, 30, timeout=10)
            with pytest.raises(errors.OperationTimeout):
                await eng.expect_imm(IMM_B, 1, timeout=0.5)
        else:  # no immediate has a known sender: all refused, A's too (the documented rule)
            assert nic["rejected"] == flood
            assert nic["rejected_unknown"] == 80
            assert nic["imms"] == 0
        # the listed peer keeps working after the flood
        await burst(a, eng, mr, b"A2", 5, IMM_A, 0)
        assert sorted(await drain_messages(eng, 5)) == sorted(b"A2 %d" % i for i in range(5))
        for p in (a, b):
            p.put(("stop",))
            assert await p.result() is True


async def test_an_unlisted_peer_stays_refused_once_the_queue_went_round(provider: str) -> None:
    """The listed peer's messages go round the engine's completion queue first; the
    unlisted peer's messages and immediates that follow are refused all the same (1.17's
    shm reports, for a sender not in the engine's AV, the source its queue slot last held:
    the listed peer's, which the list would let through)."""
    async with (
        afabric.Engine(provider, rx_depth=8, tx_depth=8) as eng,  # a completion queue of 32
        afabric.Engine(provider) as a,
        afabric.Engine(provider) as b,
    ):
        buf = np.zeros(64, dtype=np.uint8)
        mr = eng.register(buf)
        eng.allow_peers([a.address])
        for _ in range(3):
            await asyncio.gather(*(a.send(eng.address, b"A %d" % i) for i in range(40)))
            assert len(await drain_messages(eng, 40)) == 40
        src = np.arange(8, dtype=np.uint8)
        b_mr = b.register(src, remote=False)
        await asyncio.gather(*(b.send(eng.address, b"B %d" % i) for i in range(20)))
        await asyncio.gather(*(b.write(b_mr, mr.descriptor, 8, imm=IMM_B) for _ in range(20)))
        exact = exact_imm_sources(eng)
        want = {"rejected": 20 + (20 if exact else 0), "rejected_unknown": 0 if exact else 20}
        nic = await counters_reach(eng, want)
        assert {k: nic[k] for k in want} == want
        assert nic["recvs"] == 120 and nic["imms"] == 0
        await nothing_more(eng)
        with pytest.raises(errors.OperationTimeout):
            await eng.expect_imm(IMM_B, 1, timeout=0.5)
        assert eng.stats()["messages_forged"] == 0


async def test_changes_take_effect_at_once(provider: str, peers: list[Peer]) -> None:
    (a, addr_a), (b, addr_b) = await start_senders(peers, provider, 2)
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(64, dtype=np.uint8)
        mr = eng.register(buf)
        # no list: everyone
        await burst(b, eng, mr, b"B0", 3, IMM_B, 0)
        assert len(await drain_messages(eng, 3)) == 3
        eng.allow_peers([addr_a])
        await burst(b, eng, mr, b"B1", 4, IMM_B, 0)
        await burst(a, eng, mr, b"A1", 2, IMM_A, 0)
        assert sorted(await drain_messages(eng, 2)) == [b"A1 0", b"A1 1"]
        # B was resolved before (its earlier messages): now known, and refused as such
        nic = await counters_reach(eng, {"rejected": 4})
        assert nic["rejected"] == 4
        eng.allow_peers([addr_a, addr_b])
        await burst(b, eng, mr, b"B2", 3, IMM_B, 0)
        assert sorted(await drain_messages(eng, 3)) == [b"B2 0", b"B2 1", b"B2 2"]
        eng.allow_peers([addr_b])
        await burst(a, eng, mr, b"A3", 2, IMM_A, 0)
        await burst(b, eng, mr, b"B3", 1, IMM_B, 0)
        assert await drain_messages(eng, 1) == [b"B3 0"]
        nic = await counters_reach(eng, {"rejected": 6})
        assert nic["rejected"] == 6
        eng.allow_peers(None)
        assert eng.allowed_peers is None
        await burst(a, eng, mr, b"A4", 2, IMM_A, 0)
        assert sorted(await drain_messages(eng, 2)) == [b"A4 0", b"A4 1"]
        await nothing_more(eng)
        for p in (a, b):
            p.put(("stop",))
            assert await p.result() is True


async def test_unknown_sources_are_refused_unless_accepted(provider: str, peers: list[Peer]) -> None:
    """tcp;ofi_rxm gives no source for an immediate: with a list set, even the listed
    peer's immediates are refused (counted), until the list accepts unknown senders. Where
    every sender is known (shm) the flag changes nothing."""
    ((a, addr_a),) = await start_senders(peers, provider, 1)
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(64, dtype=np.uint8)
        mr = eng.register(buf)
        eng.allow_peers([addr_a])
        await burst(a, eng, mr, b"A", 2, IMM_A, 10)
        assert len(await drain_messages(eng, 2)) == 2
        if exact_imm_sources(eng):
            await eng.expect_imm(IMM_A, 10, timeout=10)
        else:
            nic = await counters_reach(eng, {"rejected_unknown": 10})
            assert nic["rejected_unknown"] == 10 and nic["imms"] == 0
            with pytest.raises(errors.OperationTimeout):
                await eng.expect_imm(IMM_A, 1, timeout=0.5)
        eng.allow_peers([addr_a], accept_unknown=True)
        await burst(a, eng, mr, b"A", 0, IMM_A, 10)
        await eng.expect_imm(IMM_A, 10, timeout=10)
        a.put(("stop",))
        assert await a.result() is True


async def target(ctl: Ctl, provider: str) -> bool:
    """A peer with a region to write into and an inbox; reports what it received."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(64, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(eng.address), bytes(mr.descriptor)))
        msgs = []
        cmd = await ctl.get()
        while True:
            try:
                msgs.append(await asyncio.wait_for(eng.recv_bytes(), 0.5))
            except asyncio.TimeoutError:
                break
        ctl.put((msgs, bytes(buf[:8])))
        return cmd == "stop"


async def test_engine_reaches_no_unlisted_peer(provider: str, peers: list[Peer]) -> None:
    listed, unlisted = Peer(target, provider), Peer(target, provider)
    peers += [listed, unlisted]
    replies = [await listed.get(), await unlisted.get()]
    (addr_l, desc_l), (addr_u, desc_u) = [
        (afabric.Address.from_bytes(a), afabric.MrDesc.from_bytes(d)) for a, d in replies
    ]
    async with afabric.Engine(provider) as eng:
        src = np.full(8, 0xAB, dtype=np.uint8)
        mr = eng.register(src, remote=False)
        await eng.send(addr_u, b"before")  # resolved while there was no list
        eng.allow_peers([addr_l])
        with pytest.raises(errors.PeerNotAllowed):  # refused at resolve: nothing posted
            await eng.write(mr, desc_u, 8)
        with pytest.raises(errors.PeerNotAllowed):  # resolved earlier: refused by the worker
            await eng.send(addr_u, b"after")
        with pytest.raises(PermissionError):
            eng.peer_group([addr_u])
        await eng.send(addr_l, b"listed")
        await eng.write(mr, desc_l, 8)
        assert eng.stats()["nics"][0]["sends"] == 2  # the refused send was never posted
    listed.put("stop")
    unlisted.put("stop")
    assert await listed.get() == ([b"listed"], b"\xab" * 8)
    assert await unlisted.get() == ([b"before"], b"\x00" * 8)
    assert await listed.result() is True and await unlisted.result() is True


async def writer(ctl: Ctl, provider: str) -> bool:
    """A peer holding a descriptor it was given: it writes, list or no list."""
    async with afabric.Engine(provider) as eng:
        src = np.full(8, 0x5A, dtype=np.uint8)
        mr = eng.register(src, remote=False)
        ctl.put(bytes(eng.address))
        desc = afabric.MrDesc.from_bytes(await ctl.get())
        await eng.write(mr, desc, 8)
        ctl.put("written")
        await ctl.get()
        return True


async def test_a_key_holder_writes_despite_the_list(provider: str, peers: list[Peer]) -> None:
    """What docs/security.md says plainly: remote keys are capabilities. An unlisted peer that
    holds a descriptor writes into it; the list stops its messages, not its writes."""
    p = Peer(writer, provider)
    peers.append(p)
    await p.get()
    async with afabric.Engine(provider, allow_peers=[]) as eng:
        buf = np.zeros(8, dtype=np.uint8)
        mr = eng.register(buf)
        p.put(bytes(mr.descriptor))
        assert await p.get() == "written"
        assert bytes(buf) == b"\x5a" * 8
        p.put("stop")
        assert await p.result() is True


async def test_bad_lists_are_refused_before_anything_changes() -> None:
    async with afabric.Engine("tcp") as eng, afabric.Engine("shm") as other:
        with pytest.raises(errors.InvalidArgument):
            eng.allow_peers(bytes(other.address))  # type: ignore[arg-type]
        with pytest.raises(errors.InvalidArgument):
            eng.allow_peers([42])  # type: ignore[list-item]
        with pytest.raises(errors.BadDescriptor):
            eng.allow_peers([b"not an address"])
        with pytest.raises(errors.WrongProvider):
            eng.allow_peers([other.address])
        with pytest.raises(errors.InvalidArgument):
            eng.allow_peers([], accept_unknown=1)  # type: ignore[arg-type]
        assert eng.allowed_peers is None  # nothing was installed
        eng.allow_peers([])  # an empty list: nobody
        with pytest.raises(errors.PeerNotAllowed):
            await eng.send(other.address, b"x")  # (the provider check comes after the list)
