"""cma's segment (providers/common/node_seg.h) is shared memory that any process of the uid
can write. A corrupt or half-written one must fail operations to that peer only, with an
afabric error and in bounded time, never crash or wedge the engines that talk to it.

A seeded fuzzer maps a live target's segment from this process and damages it: the ring's
size (0, huge), its positions, padding of 0 bytes, records running past the ring's end or
the tail, unknown kinds, random bytes over the header and the record at the head, the
ring's lock held by a domain that was SIGKILLed, by one that lives and never lets go, or by
bytes that name no domain, and the writer slots likewise (they name processes). After each damage an honest
writer (its own process) runs a write with an immediate, a send and a write large enough
for the copy threads: each succeeds or fails with an afabric error within OP_BOUND. Then
the target's own ring is checked to be sound again (the owner resets what it finds
corrupt), and the target, that writer and a second peer must all work: both peers' writes
with immediates arrive, and the target writes to the second peer. The target never dies.
"""

from __future__ import annotations

import asyncio
import glob
import mmap
import os
import random
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

import afabric
from afabric import errors

from .procs import Ctl, Peer

SEED = 20240611
RANDOM_CASES = 24
BUDGET_S = 45.0  # random cases stop being started after this (the fixed ones always run)
OP_BOUND = 15.0  # s an operation may take to succeed or fail (the stall bounds are 2 s)
OP_TIMEOUT = 60.0  # the writers' op_timeout: far above OP_BOUND, a timeout cannot pass
EXPECT_S = 15.0
SMALL = 4096
LARGE = 64 * 1024  # run whole on a copy thread (cma_pool.h: AFABRIC_CMA_ASYNC_AT, 16 KiB)

# node_seg.h's layout (pinned there by _Static_assert)
MAGIC = 0x31414D4331414641  # "AFA1CMA1"
VERSION = 3
CLOSED_WORD = 0xC105ED
HDR_BYTES = 104
OFF_CLOSED, OFF_RING_BYTES, OFF_EXPORTS_OFF, OFF_RING_OFF = 24, 36, 40, 48
OFF_LOCK, OFF_LOCK_SEQ, OFF_HEAD, OFF_TAIL, OFF_RESETS = 64, 72, 80, 88, 96
REC_PAD, REC_IMM, REC_MSG = 0, 1, 2
SLOTS, SLOT_BYTES = 64, 64  # cma.c's writer slots, after the ring


def segment_path(pid: int) -> str:
    """The one cma segment of process pid ("<pid>:afabric-cma-<token>", node_seg.c)."""
    [path] = glob.glob(f"/dev/shm/{pid}:afabric-cma-*")
    return path


class Segment:
    """A cma domain's segment mapped here, found by its owner's pid."""

    def __init__(self, pid: int) -> None:
        path = segment_path(pid)
        fd = os.open(path, os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        assert (self.u64(0), self.u32(8)) == (MAGIC, VERSION), "not the layout this test knows"
        self.ring_off = self.u64(OFF_RING_OFF)
        self.ring_bytes = self.u32(OFF_RING_BYTES)
        self.slots_off = self.ring_off + self.ring_bytes
        self.fixed = self.fixed_fields()  # what the owner must keep there

    def u32(self, off: int) -> int:
        return int(struct.unpack_from("<I", self.mm, off)[0])

    def u64(self, off: int) -> int:
        return int(struct.unpack_from("<Q", self.mm, off)[0])

    def set32(self, off: int, v: int) -> None:
        struct.pack_into("<I", self.mm, off, v & 0xFFFFFFFF)

    def set64(self, off: int, v: int) -> None:
        struct.pack_into("<Q", self.mm, off, v & 0xFFFFFFFFFFFFFFFF)

    def record_at_head(self, kind: int, imm: int, arg: int, published: int) -> None:
        """A record where the owner reads next, and the tail moved `published` bytes on."""
        head = self.u64(OFF_HEAD)
        struct.pack_into("<IIQ", self.mm, self.ring_off + head % self.ring_bytes, kind, imm, arg)
        self.set64(OFF_TAIL, head + published)

    def head_offset(self) -> int:
        return self.u64(OFF_HEAD) % self.ring_bytes

    def fixed_fields(self) -> bytes:
        """magic .. pidns, but `sleeping` (the owner's own, moving)."""
        return bytes(self.mm[0:28]) + bytes(self.mm[32:64])

    def sound(self) -> bool:
        """The owner's view is consistent again: fixed fields, positions, nothing pending."""
        head, tail = self.u64(OFF_HEAD), self.u64(OFF_TAIL)
        return self.fixed_fields() == self.fixed and tail == head and head % 16 == 0

    def close(self) -> None:
        self.mm.close()


# ---- the processes -----------------------------------------------------------------------


async def target(ctl: Ctl) -> bool:
    """The engine whose segment is damaged: answers commands until "stop"."""
    async with afabric.Engine("cma") as eng:
        buf = np.zeros(1 << 20, np.uint8)
        mr = eng.register(buf)
        ctl.put((bytes(mr.descriptor), bytes(eng.address), os.getpid()))

        async def sink() -> None:
            while True:
                await eng.recv()

        drain = asyncio.ensure_future(sink())
        src = eng.register(np.ones(SMALL, np.uint8), remote=False)
        try:
            while True:
                cmd = await ctl.get(timeout=600)
                if cmd == "stop":
                    return True
                if cmd == "imms":
                    ctl.put([eng.alloc_imm() for _ in range(2)])
                elif cmd[0] == "expect":
                    for imm in cmd[1]:
                        await eng.expect_imm(imm, 1, timeout=EXPECT_S)
                    ctl.put("ok")
                elif cmd[0] == "write_to":
                    dst = afabric.MrDesc.from_bytes(cmd[1])
                    await asyncio.wait_for(eng.write(src, dst, SMALL, imm=cmd[2]), OP_BOUND)
                    ctl.put("ok")
                elif cmd == "dereg":
                    extra = eng.register(np.zeros(SMALL, np.uint8))
                    eng.deregister(extra)
                    ctl.put("ok")
                elif cmd == "errors":
                    ctl.put(eng.stats()["nics"][0]["errors"])
        finally:
            drain.cancel()


async def outcome(op: Awaitable[Any]) -> tuple[str, str]:
    """("ok", ""), ("error", text) for an afabric error, ("stuck", ...) past OP_BOUND or when
    the engine's worker was found stuck (it closed itself), or ("foreign", ...) for any other
    exception."""
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(op, OP_BOUND)
        return ("ok", "")
    except (errors.EngineStuck, errors.EngineClosed) as e:
        return ("stuck", f"{type(e).__name__}: {e}")
    except errors.AfabricError as e:
        return ("error", f"{type(e).__name__}: {e}")
    except asyncio.TimeoutError:
        return ("stuck", f"no answer in {time.monotonic() - t0:.1f} s")
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        return ("foreign", repr(e))


async def writer(ctl: Ctl, desc_b: bytes, addr_b: bytes) -> bool:
    """An honest peer of the target: writes and sends on command, and is written to."""
    async with afabric.Engine("cma", op_timeout=OP_TIMEOUT) as eng:
        desc, addr = afabric.MrDesc.from_bytes(desc_b), afabric.Address.from_bytes(addr_b)
        src = eng.register(np.ones(LARGE, np.uint8), remote=False)
        inbox = eng.register(np.zeros(SMALL, np.uint8))
        ctl.put(bytes(inbox.descriptor))
        while True:
            cmd = await ctl.get(timeout=600)
            if cmd == "stop":
                return True
            if cmd[0] == "ops":  # after a damage: each must end, one way or the other
                imm = cmd[1]
                ctl.put(
                    [
                        await outcome(eng.write(src, desc, SMALL, imm=imm)),
                        await outcome(eng.send(addr, b"after the damage")),
                        await outcome(eng.write(src, desc, LARGE, dst_offset=LARGE, imm=imm)),
                    ]
                )
            elif cmd[0] == "write":  # must work
                await asyncio.wait_for(eng.write(src, desc, SMALL, imm=cmd[1]), OP_BOUND)
                ctl.put("ok")
            elif cmd == "imm":
                ctl.put(eng.alloc_imm())
            elif cmd[0] == "expect":
                await eng.expect_imm(cmd[1], 1, timeout=EXPECT_S)
                ctl.put("ok")


async def bystander_domain(ctl: Ctl) -> bool:
    """A live cma domain that does nothing: its token is the one a damage writes as holder."""
    async with afabric.Engine("cma"):
        ctl.put(os.getpid())
        await ctl.get(timeout=600)
    return True


# ---- the damages -------------------------------------------------------------------------


class World:
    """What a damage may use: the segment, the random source, a way to start a domain."""

    def __init__(self, seg: Segment, rng: random.Random, peers: list[Peer]) -> None:
        self.seg, self.rng, self.peers = seg, rng, peers

    async def domain(self) -> tuple[Peer, int, int]:
        """A live cma domain in its own process, its token and its pid."""
        p = Peer(bystander_domain)
        self.peers.append(p)
        pid = await p.get()
        return p, int(segment_path(pid).rsplit("-", 1)[1], 16), pid


Undo = Callable[[], Awaitable[None]] | None


async def ring_size_zero(w: World) -> Undo:
    w.seg.set32(OFF_RING_BYTES, 0)  # was: SIGFPE in every process that read it
    return None


async def ring_size_huge(w: World) -> Undo:
    w.seg.set32(OFF_RING_BYTES, 0xFFFFFFF0)
    w.seg.set64(OFF_RING_OFF, 1 << 60)
    w.seg.set64(OFF_EXPORTS_OFF, (1 << 64) - 4096)
    return None


async def padding_of_zero_bytes(w: World) -> Undo:
    w.seg.record_at_head(REC_PAD, 0, 0, 16)  # was: the owner spun on it for ever
    return None


async def message_past_the_ring_end(w: World) -> Undo:
    room = w.seg.ring_bytes - w.seg.head_offset()
    w.seg.record_at_head(REC_MSG, 0, room, 16 * 4)  # its payload would run over the end
    return None


async def message_past_the_tail(w: World) -> Undo:
    w.seg.record_at_head(REC_MSG, 0, 4096, 32)
    return None


async def message_too_large(w: World) -> Undo:
    w.seg.record_at_head(REC_MSG, 0, 1 << 62, 32)
    return None


async def imm_of_no_arrivals(w: World) -> Undo:
    w.seg.record_at_head(REC_IMM, 9, 0, 16)
    return None


async def imm_of_too_many_arrivals(w: World) -> Undo:
    w.seg.record_at_head(REC_IMM, 9, 1 << 62, 16)
    return None


async def unknown_kind(w: World) -> Undo:
    w.seg.record_at_head(0x7A7A, 9, 1, 16)
    return None


async def tail_not_a_position(w: World) -> Undo:
    w.seg.set64(OFF_TAIL, w.seg.u64(OFF_HEAD) + w.seg.ring_bytes * 3 + 8)
    return None


async def head_not_a_position(w: World) -> Undo:
    w.seg.set64(OFF_HEAD, w.seg.u64(OFF_TAIL) + 12345)
    return None


async def lock_of_a_killed_domain(w: World) -> Undo:
    p, token, _ = await w.domain()
    w.seg.set64(OFF_LOCK, token)
    p.kill()  # held by a domain that died holding it (its segment's flock is free now)
    return None


async def lock_of_no_domain(w: World) -> Undo:
    w.seg.set64(OFF_LOCK, 0xDEAD_BEEF_0BAD_F00D)
    return None


async def lock_of_a_live_domain(w: World) -> Undo:
    p, token, _ = await w.domain()
    w.seg.set64(OFF_LOCK, token)  # alive and never lets go: writers give up after 2 s

    async def undo() -> None:
        w.seg.set64(OFF_LOCK, 0)
        p.put("stop")
        await p.result()

    return undo


async def slots_of_no_process(w: World) -> Undo:
    for i in range(SLOTS):  # pids far above any pid_max
        w.seg.set64(w.seg.slots_off + i * SLOT_BYTES, (i + 1) << 32 | 0x5EED0000 | i)
    return None


async def slots_of_a_killed_writer(w: World) -> Undo:
    p, _, pid = await w.domain()
    for i in range(SLOTS):
        w.seg.set64(w.seg.slots_off + i * SLOT_BYTES, 1 << 32 | pid)
    p.kill()  # died holding them all (mid-copy)
    return None


async def slots_of_a_live_writer(w: World) -> Undo:
    p, _, pid = await w.domain()
    for i in range(SLOTS):
        w.seg.set64(w.seg.slots_off + i * SLOT_BYTES, 1 << 32 | pid)

    async def undo() -> None:
        for i in range(SLOTS):
            w.seg.set64(w.seg.slots_off + i * SLOT_BYTES, 0)
        p.put("stop")
        await p.result()

    return undo


async def random_header_bytes(w: World) -> Undo:
    start = w.rng.randrange(0, HDR_BYTES - 1)
    end = w.rng.randrange(start + 1, HDR_BYTES + 1)
    w.seg.mm[start:end] = w.rng.randbytes(end - start)
    if w.seg.u32(OFF_CLOSED) == CLOSED_WORD:  # that one word means "closed": believed
        w.seg.set32(OFF_CLOSED, 0)
    return None


async def random_record(w: World) -> Undo:
    off = w.seg.ring_off + w.seg.head_offset()
    w.seg.mm[off : off + 16] = w.rng.randbytes(16)
    w.seg.set64(OFF_TAIL, w.seg.u64(OFF_HEAD) + 16 * w.rng.randrange(1, 5))
    return None


async def random_positions(w: World) -> Undo:
    w.seg.set64(w.rng.choice([OFF_HEAD, OFF_TAIL]), w.rng.getrandbits(64))
    return None


async def random_slots(w: World) -> Undo:
    for i in w.rng.sample(range(SLOTS), w.rng.randrange(1, SLOTS + 1)):
        w.seg.set64(w.seg.slots_off + i * SLOT_BYTES, w.rng.getrandbits(64))
    return None


FIXED = [
    ring_size_zero, ring_size_huge, padding_of_zero_bytes, message_past_the_ring_end,
    message_past_the_tail, message_too_large, imm_of_no_arrivals, imm_of_too_many_arrivals,
    unknown_kind, tail_not_a_position, head_not_a_position, lock_of_a_killed_domain,
    lock_of_no_domain, lock_of_a_live_domain, slots_of_no_process, slots_of_a_killed_writer,
    slots_of_a_live_writer,
]  # fmt: skip
RANDOM = [random_header_bytes, random_record, random_positions, random_slots]


# ---- the test ----------------------------------------------------------------------------


async def wait_sound(seg: Segment, what: str) -> None:
    """The target has reset its ring and put its header back (it does so on its own)."""
    deadline = time.monotonic() + 10
    while not seg.sound():
        assert time.monotonic() < deadline, f"{what}: the target did not repair its segment"
        await asyncio.sleep(0.005)


async def all_work(t: Peer, w: Peer, b: Peer, inbox_b: bytes) -> None:
    """Both peers' writes with immediates reach the target; the target writes to b."""
    t.put("imms")
    imm_w, imm_b = await t.get()
    w.put(("write", imm_w))
    b.put(("write", imm_b))
    assert await w.get(timeout=OP_BOUND + 5) == "ok"
    assert await b.get(timeout=OP_BOUND + 5) == "ok"
    t.put(("expect", [imm_w, imm_b]))
    assert await t.get(timeout=EXPECT_S + 5) == "ok"
    b.put("imm")
    imm = await b.get()
    b.put(("expect", imm))
    t.put(("write_to", inbox_b, imm))
    assert await t.get(timeout=OP_BOUND + 5) == "ok"
    assert await b.get(timeout=EXPECT_S + 5) == "ok"


async def test_damaged_mailbox_fails_only_that_peer(peers: list[Peer], shm_cleanup: None) -> None:
    t = Peer(target)
    peers.append(t)
    desc_t, addr_t, pid_t = await t.get()
    w, b = Peer(writer, desc_t, addr_t), Peer(writer, desc_t, addr_t)
    peers += [w, b]
    await w.get()
    inbox_b = await b.get()
    seg = Segment(pid_t)
    world = World(seg, random.Random(SEED), peers)
    try:
        await all_work(t, w, b, inbox_b)  # every peer resolved, hellos exchanged
        await wait_sound(seg, "before")
        rng = random.Random(SEED + 1)
        cases = [*FIXED, *(rng.choice(RANDOM) for _ in range(RANDOM_CASES))]
        t0 = time.monotonic()
        failed: list[str] = []
        for n, damage in enumerate(cases):
            if n >= len(FIXED) and time.monotonic() - t0 > BUDGET_S:
                print(f"budget spent: {n - len(FIXED)} of {RANDOM_CASES} random damages run")
                break
            name = damage.__name__
            undo = await damage(world)
            t.put("imms")
            imm, _ = await t.get()
            w.put(("ops", imm))
            got = await w.get(timeout=3 * OP_BOUND + 10)
            print(f"{name}: {got}")
            for kind, text in got:
                assert kind in ("ok", "error"), f"{name}: {kind} {text}"
                if kind == "error":
                    failed.append(name)
            if undo is not None:
                await undo()
            assert t.proc.is_alive(), f"{name}: the target died (exit {t.proc.exitcode})"
            await wait_sound(seg, name)
            await all_work(t, w, b, inbox_b)
            t.put("dereg")  # waits for the writer slots held now: none stays held
            assert await t.get(timeout=OP_BOUND) == "ok"
        # the live holders are the only damages writers cannot get past
        assert {"lock_of_a_live_domain", "slots_of_a_live_writer"} <= set(failed), failed
        assert seg.u64(OFF_RESETS) > 0  # the target found its ring corrupt, and reset it
        t.put("errors")
        assert await t.get() > 0  # and said so (a failed receive, counted)
        # a peer that attaches now (after all that) works too
        fresh = Peer(writer, desc_t, addr_t)
        peers.append(fresh)
        await fresh.get()
        await all_work(t, fresh, b, inbox_b)
        for p in (t, w, b, fresh):
            p.put("stop")
            assert await p.result() is True
    finally:
        seg.close()
