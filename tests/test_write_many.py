"""write_many: many writes in one call and one future, between real processes (every byte
and every immediate counted at the target), bad input refused with nothing posted, and the
remote-id shortcut a descriptor keeps staying correct when the engine drops ids."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

import afabric
from afabric import engine as engine_mod
from afabric import errors

from .procs import Ctl, Peer

BLOCK = 4096
NBLOCKS = 256  # per region
REGION = BLOCK * NBLOCKS


def source() -> np.ndarray:
    return np.random.default_rng(15).integers(0, 256, 2 * REGION, dtype=np.uint8)


def plan() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Write k of the first call: block src[k] of the source to block dst[k] of region A,
    lengths varying (1 B .. 4 KiB) so that no write covers a whole block by accident."""
    rng = np.random.default_rng(16)
    src = rng.permutation(2 * NBLOCKS)[:NBLOCKS].astype(np.int64)
    dst = rng.permutation(NBLOCKS).astype(np.int64)
    lengths = rng.integers(1, BLOCK + 1, NBLOCKS).astype(np.int64)
    return src, dst, lengths


def expected_a() -> np.ndarray:
    want = np.zeros(REGION, np.uint8)
    s = source()
    src, dst, lengths = plan()
    for k in range(NBLOCKS):
        n = int(lengths[k])
        want[dst[k] * BLOCK : dst[k] * BLOCK + n] = s[src[k] * BLOCK : src[k] * BLOCK + n]
    return want


# the second call: one descriptor per write, A and B alternately (after the first call
# completed, so its two writes to A land over the first call's bytes)
SECOND_DESCS = ["b", "a", "b", "a"]
SECOND_SRC = [0, REGION, BLOCK, REGION + BLOCK]
SECOND_DST = [0, 5 * BLOCK, 2 * BLOCK, 9 * BLOCK]


def expected_after_second() -> tuple[np.ndarray, np.ndarray]:
    s = source()
    want = {"a": expected_a(), "b": np.zeros(REGION, np.uint8)}
    for which, so, do in zip(SECOND_DESCS, SECOND_SRC, SECOND_DST, strict=True):
        want[which][do : do + BLOCK] = s[so : so + BLOCK]
    return want["a"], want["b"]


async def target(ctl: Ctl, provider: str) -> bool:
    """Two regions; counts the immediates of each call and checks every byte."""
    async with afabric.Engine(provider) as eng:
        a, b = np.zeros(REGION, np.uint8), np.zeros(REGION, np.uint8)
        ma, mb = eng.register(a), eng.register(b)
        ctl.put((bytes(ma.descriptor), bytes(mb.descriptor)))
        imm1, imm2 = await ctl.get()
        # one arrival per write: NBLOCKS for the first call, 4 for the second
        await eng.expect_imm(imm1, NBLOCKS, timeout=60)
        await eng.expect_imm(imm2, len(SECOND_DESCS), timeout=60)
        want_a, want_b = expected_after_second()
        assert np.array_equal(a, want_a), f"region A: {np.count_nonzero(a != want_a)} wrong bytes"
        assert np.array_equal(b, want_b), f"region B: {np.count_nonzero(b != want_b)} wrong bytes"
        # and not one arrival more than the writes made
        for imm in (imm1, imm2):
            with pytest.raises(errors.OperationTimeout):
                await eng.expect_imm(imm, 1, timeout=0.5)
        return True


async def test_write_many_across_processes(provider: str, peers: list[Peer]) -> None:
    p = Peer(target, provider)
    peers.append(p)
    blob_a, blob_b = await p.get()
    desc = {"a": afabric.MrDesc.from_bytes(blob_a), "b": afabric.MrDesc.from_bytes(blob_b)}
    async with afabric.Engine(provider) as eng:
        mr = eng.register(source())
        imm1, imm2 = eng.alloc_imm(), eng.alloc_imm()
        p.put((imm1, imm2))
        src, dst, lengths = plan()
        # one descriptor, numpy columns (int64)
        await eng.write_many(mr, desc["a"], lengths, src * BLOCK, dst * BLOCK, imm=imm1)
        # one descriptor per write, plain lists, and a length for all
        descs = [desc[w] for w in SECOND_DESCS]
        await eng.write_many(mr, descs, BLOCK, SECOND_SRC, SECOND_DST, imm=imm2)
        assert await p.result()


async def test_write_many_refuses_bad_input_with_nothing_posted(provider: str) -> None:
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        small, big = np.zeros(BLOCK, np.uint8), np.zeros(4 * BLOCK, np.uint8)
        ms, mb = b.register(small), b.register(big)
        ds, db = ms.descriptor, mb.descriptor
        mr = a.register(np.ones(4 * BLOCK, np.uint8))
        other = b.register(np.ones(BLOCK, np.uint8))  # another engine's region as the source
        ok: dict[str, Any] = {"lengths": [8, 8], "src_offsets": 0, "dst_offsets": [0, 8]}
        cases: list[tuple[type[Exception], dict[str, Any]]] = [
            # ranges: checked by the shim for every write before any is posted
            (errors.OutOfRange, {**ok, "dst_offsets": [0, 4 * BLOCK - 7]}),
            (errors.OutOfRange, {**ok, "src_offsets": [0, 4 * BLOCK - 7]}),
            (errors.OutOfRange, {"remote_desc": [db, ds], "lengths": BLOCK + 1}),
            (errors.OutOfRange, {**ok, "lengths": [8, 2**64 - 1]}),
            # types and shapes: checked in Python
            (errors.OutOfRange, {**ok, "lengths": [8, -1]}),
            (errors.OutOfRange, {**ok, "lengths": np.array([8, -1])}),
            (errors.OutOfRange, {**ok, "src_offsets": -8}),
            (errors.OutOfRange, {**ok, "lengths": [8, 2**64]}),
            (errors.InvalidArgument, {**ok, "lengths": [8, 8.0]}),
            (errors.InvalidArgument, {**ok, "lengths": [8, True]}),
            (errors.InvalidArgument, {**ok, "lengths": np.array([8.0, 8.0])}),
            (errors.InvalidArgument, {**ok, "lengths": np.array([[8, 8]])}),
            (errors.InvalidArgument, {**ok, "lengths": b"\x08\x08"}),
            (errors.InvalidArgument, {**ok, "lengths": "88"}),
            (errors.InvalidArgument, {**ok, "lengths": (n for n in (8, 8))}),
            (errors.InvalidArgument, {**ok, "dst_offsets": [0, 8, 16]}),
            (errors.InvalidArgument, {"lengths": 8, "src_offsets": 0, "dst_offsets": 0}),
            (errors.InvalidArgument, {**ok, "remote_desc": [db, db, db]}),
            (errors.InvalidArgument, {**ok, "remote_desc": [db, "x"]}),
            (errors.InvalidArgument, {**ok, "remote_desc": 5}),
            (errors.BadDescriptor, {**ok, "remote_desc": [db, b"\x00" * 40]}),
            (errors.ImmediateOutOfRange, {**ok, "imm": 2**32}),
            (errors.InvalidArgument, {**ok, "when": 5}),
            (errors.StaleRegion, {**ok, "mr": other}),
            (errors.InvalidArgument, {**ok, "mr": np.ones(8, np.uint8)}),
        ]
        for want, case in cases:
            kw = {"mr": mr, "remote_desc": db, "imm": 9, **case}
            with pytest.raises(want):
                await a.write_many(**kw)
        with pytest.raises(errors.OperationTimeout):
            await b.expect_imm(9, 1, timeout=0.3)
        assert not small.any() and not big.any(), "a refused write_many wrote something"
        # the same call, well formed, goes through: an empty one completes at once
        await a.write_many(mr, db, [], imm=9)
        await a.write_many(mr, [db, ds], 8, 0, [8, 0], imm=9)
        await b.expect_imm(9, 2, timeout=10)
        assert big[8:16].all() and small[:8].all() and not big[:8].any()


async def test_remote_id_shortcut_survives_eviction_and_allow_list(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A descriptor keeps the id its engine imported it as; when the engine releases that
    id (its cache evicts it, allow_peers resets it) the next write must import it again,
    not use the released id."""
    monkeypatch.setattr(engine_mod, "_REMOTE_CACHE_MAX", 2)
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b, afabric.Engine(provider) as c:
        bufs = [np.zeros(64, np.uint8) for _ in range(3)]
        descs = [b.register(x).descriptor for x in bufs]
        mr = a.register(np.arange(64, dtype=np.uint8))
        for round_ in range(2):
            for k, d in enumerate(descs):  # the third evicts the first's id
                await a.write(mr, d, 8, src_offset=8 * k, dst_offset=8 * round_)
        await a.write(mr, descs[0], 8, src_offset=40, dst_offset=16)
        a.allow_peers([b.address])  # releases every imported id
        await a.write(mr, descs[0], 8, src_offset=48, dst_offset=24)  # its id was just released
        await c.write(c.register(np.full(8, 7, np.uint8)), descs[2], 8, dst_offset=32)  # another engine
        await a.write(mr, descs[2], 8, src_offset=56, dst_offset=40)
        for k, x in enumerate(bufs):
            assert list(x[0:8]) == list(range(8 * k, 8 * k + 8))
            assert list(x[8:16]) == list(range(8 * k, 8 * k + 8))
        assert list(bufs[0][16:24]) == list(range(40, 48))
        assert list(bufs[0][24:32]) == list(range(48, 56))
        assert list(bufs[2][32:40]) == [7] * 8 and list(bufs[2][40:48]) == list(range(56, 64))


async def test_one_call_to_more_descriptors_than_the_engine_keeps(
    provider: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call naming more descriptors than the engine's import cache holds (or making it
    evict one the same call named earlier) still posts with live ids: evicted ids are
    released only after the call went into the shim."""
    monkeypatch.setattr(engine_mod, "_REMOTE_CACHE_MAX", 2)
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        bufs = [np.zeros(64, np.uint8) for _ in range(4)]
        descs = [b.register(x).descriptor for x in bufs]
        mr = a.register(np.arange(64, dtype=np.uint8))
        await a.write(mr, descs[0], 8)  # cached, the oldest: the next call evicts it
        await a.write_many(mr, [descs[0], descs[1], descs[2], descs[3], descs[0]], 8, 8, [8, 8, 8, 8, 16])
        await a.scatter(mr, [afabric.ScatterTarget(d, 8, 16, 24) for d in descs])
        await a.barrier(descs, 77)
        await b.expect_imm(77, 4, timeout=10)
        for k, x in enumerate(bufs):
            assert list(x[8:16]) == list(range(8, 16)), k
            assert list(x[24:32]) == list(range(16, 24)), k
        assert list(bufs[0][16:24]) == list(range(8, 16))


async def test_native_write_ids_are_per_thread(provider: str) -> None:
    """NativeEngine.write reuses one result word on the engine's own thread only: the loop
    thread and other threads writing at once (the GIL is released during the call) never
    see each other's operation ids."""
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        mr = a.register(np.ones(64, np.uint8))
        dst = np.zeros(64, np.uint8)
        rid, _ = a._remote(b.register(dst).descriptor)
        mr_id = mr.check(a)
        ids: list[list[int]] = [[] for _ in range(4)]
        start = threading.Barrier(4)

        def run(k: int) -> None:
            start.wait()
            for _ in range(1500):
                ids[k].append(a._n.write("write", mr_id, rid, 8, 0, 0, -1))

        ts = [threading.Thread(target=run, args=(k,)) for k in range(1, 4)]
        for t in ts:
            t.start()
        run(0)  # this thread is the loop's: it uses the engine's own result word
        for t in ts:
            t.join()
        got = [i for row in ids for i in row]
        assert len(set(got)) == len(got), f"{len(got) - len(set(got))} operation ids handed out twice"
        await a.write(mr, b.register(np.zeros(8, np.uint8)).descriptor, 8)  # the engine still works
