"""Peer identity by proof, not by claim: a third process that forges a later incarnation of
a live peer (in a keepalive hello, in an address or a descriptor) takes nothing away from
it. Only a frame from the provider-named sender at a NIC address, stating its own
incarnation, retires an older incarnation there; an incarnation dated far ahead of this
host's clock is refused outright."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import zlib

import numpy as np
import pytest

import afabric
from afabric import errors

from .conftest import WITH_CMA
from .procs import Ctl, Peer

REGION = 4096
KA_PING = 1


def with_incarnation(blob: bytes, incarnation: int) -> bytes:
    """An address with another incarnation and its checksum recomputed, as anyone holding
    the address can make (shim/codec.c: "AFA1" u8 u8 u16 then the u64 incarnation)."""
    body = bytearray(blob[:-4])
    struct.pack_into("<Q", body, 8, incarnation)
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


def desc_with_incarnation(blob: bytes, incarnation: int) -> bytes:
    """A descriptor whose owner address carries another incarnation (its embedded address
    and the descriptor's own checksum recomputed)."""
    addr_len = struct.unpack_from("<I", blob, 4)[0]
    addr = with_incarnation(blob[8 : 8 + addr_len], incarnation)
    body = blob[:8] + addr + blob[8 + addr_len : -4]
    return body + struct.pack("<I", zlib.crc32(body))


def hello_frame(claimed: bytes, incarnation: int) -> bytes:
    """A keepalive hello (shim/keepalive.c): magic, version 1, PING, address length, two
    zero bytes, the stated incarnation, then the claimed address."""
    return b"\xafK" + bytes([1, KA_PING]) + struct.pack("<HHQ", len(claimed), 0, incarnation) + claimed


async def target(ctl: Ctl, provider: str) -> int:
    """B: a live, honest peer that exposes a region and counts what lands in it."""
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(REGION, dtype=np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(mr.descriptor), bytes(eng.address)))
        got = 0
        while (cmd := await ctl.get()) != "stop":
            if cmd == "recv":
                msg = await asyncio.wait_for(eng.recv(), 30)
                got += 1
                ctl.put((bytes(msg.data), msg.verified))
            elif cmd == "sum":
                ctl.put(int(buf.sum()))
        return got


async def forger(ctl: Ctl, provider: str, a_addr: bytes, frames: list[bytes]) -> int:
    """C: a third engine that sends A raw keepalive hellos (what the shim would send, with
    a made-up claim inside)."""
    async with afabric.Engine(provider) as eng:
        pid, _ = eng._peer(afabric.Address.from_bytes(a_addr))
        for frame in frames:
            eng._n.send("forged hello", pid, frame)
        ctl.put("sent")
        await ctl.get()
        return len(frames)


def ctrl_received(eng: afabric.Engine) -> int:
    return sum(int(n["ctrl_received"]) for n in eng.stats()["nics"])


async def keep_writing(
    eng: afabric.Engine,
    b: Peer,
    src: tuple[afabric.MemoryRegion, np.ndarray],
    desc: afabric.MrDesc,
    addr: afabric.Address,
    rounds: int,
) -> None:
    """A's writes and messages to B all go through, and land."""
    mr, buf = src
    for i in range(rounds):
        buf[:] = i + 1
        await eng.write(mr, desc, REGION)
        b.put("sum")
        assert await b.get() == REGION * (i + 1)
        await eng.send(addr, b"still you %d" % i)
        b.put("recv")
        data, _ = await b.get()
        assert data == b"still you %d" % i


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_forged_later_incarnation_takes_no_live_peer_away(provider: str, peers: list[Peer]) -> None:
    """A third process claims B's address with B's incarnation + 1, in a hello to A and in
    an address and a descriptor A imports; A goes on writing to and messaging B. Before:
    every write and send to B failed with StaleRegion ("has restarted") from then on."""
    b = Peer(target, provider)
    peers.append(b)
    desc_b, addr_b = await b.get()
    desc, addr = afabric.MrDesc.from_bytes(desc_b), afabric.Address.from_bytes(addr_b)
    async with afabric.Engine(provider, op_timeout=10) as a:
        buf = np.zeros(REGION, dtype=np.uint8)
        src = (a.register(buf), buf)
        await keep_writing(a, b, src, desc, addr, 1)

        later = addr.incarnation + 1
        forged_addr = with_incarnation(addr_b, later)
        before = ctrl_received(a)
        c = Peer(forger, provider, bytes(a.address), [hello_frame(forged_addr, later)])
        peers.append(c)
        assert await c.get() == "sent"
        for _ in range(1000):  # the hello reached A's worker
            if ctrl_received(a) > before:
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("the forged hello never arrived")
        await asyncio.sleep(0.5)  # learned, resolved, hello sent to B's NIC address, answered
        await keep_writing(a, b, src, desc, addr, 3)

        # the same claim in an address and a descriptor that A imports
        fake = afabric.Address.from_bytes(forged_addr)
        fake_desc = afabric.MrDesc.from_bytes(desc_with_incarnation(desc_b, later))
        assert fake.incarnation == later and fake_desc.incarnation == later
        with contextlib.suppress(errors.AfabricError):  # it lands in B's region under B's key
            await a.write(src[0], fake_desc, REGION)
        try:
            await a.send(fake, b"to the claim")
        except errors.AfabricError:
            pass
        else:
            b.put("recv")  # B got it: it is B's NIC address; nothing is taken from B
            data, _ = await b.get()
            assert data == b"to the claim"
        await asyncio.sleep(0.3)
        await keep_writing(a, b, src, desc, addr, 3)
        c.put("stop")
        assert await c.result() == 1
    b.put("stop")
    assert await b.result() >= 7


@pytest.mark.parametrize("provider", ["tcp", "cma"])
async def test_incarnation_far_ahead_of_the_clock_is_refused(provider: str, peers: list[Peer]) -> None:
    """An incarnation dated beyond any clock skew (2**64 - 1: before, it stood above every
    later restart of the peer for good) is refused on import, typed, and nothing of B is
    taken away; a hello claiming it learns nothing."""
    b = Peer(target, provider)
    peers.append(b)
    desc_b, addr_b = await b.get()
    desc, addr = afabric.MrDesc.from_bytes(desc_b), afabric.Address.from_bytes(addr_b)
    top = 2**64 - 1
    async with afabric.Engine(provider, op_timeout=10) as a:
        buf = np.zeros(REGION, dtype=np.uint8)
        src = (a.register(buf), buf)
        with pytest.raises(errors.BadDescriptor, match="ahead of this host's clock"):
            await a.send(afabric.Address.from_bytes(with_incarnation(addr_b, top)), b"x")
        with pytest.raises(errors.BadDescriptor, match="ahead of this host's clock"):
            await a.write(src[0], afabric.MrDesc.from_bytes(desc_with_incarnation(desc_b, top)), 8)
        before = ctrl_received(a)
        c = Peer(forger, provider, bytes(a.address), [hello_frame(with_incarnation(addr_b, top), top)])
        peers.append(c)
        assert await c.get() == "sent"
        for _ in range(1000):
            if ctrl_received(a) > before:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        await keep_writing(a, b, src, desc, addr, 2)
        c.put("stop")
        await c.result()
    b.put("stop")
    await b.result()


async def test_a_hello_claiming_another_nic_address_is_not_learned(peers: list[Peer]) -> None:
    """Where the provider names the sender of a hello (a peer resolved here), the address it
    claims must be that sender's: C, known to A, claiming B's address is not learned, so A
    resolves nothing for it (its peer table does not grow)."""
    b = Peer(target, "tcp")
    peers.append(b)
    _, addr_b = await b.get()
    async with afabric.Engine("tcp", op_timeout=10) as a:
        c = Peer(forger_known, bytes(a.address), addr_b)
        peers.append(c)
        c_addr = await c.get()
        await a.send(afabric.Address.from_bytes(c_addr), b"now I know you")  # resolved here
        c.put("go")
        assert await c.get() == "sent"
        await asyncio.sleep(0.5)
        learned = bytes(afabric.Address.from_bytes(addr_b)) in a._peers
        assert not learned, "a claim of another NIC address was learned"
        c.put("stop")
        await c.result()
    b.put("stop")
    await b.result()


async def forger_known(ctl: Ctl, a_addr: bytes, claimed: bytes) -> None:
    """C, resolved by A first, then sending A a hello that claims B's address."""
    async with afabric.Engine("tcp") as eng:
        ctl.put(bytes(eng.address))
        await asyncio.wait_for(eng.recv(), 30)
        await ctl.get()
        pid, _ = eng._peer(afabric.Address.from_bytes(a_addr))
        inc = afabric.Address.from_bytes(claimed).incarnation
        eng._n.send("forged hello", pid, hello_frame(claimed, inc))
        ctl.put("sent")
        await ctl.get()
