"""Property-based checks of everything that parses bytes from a peer or a user, and of the
write path's argument checks: any input gives a result or a typed error, never a crash,
and a refused write posts nothing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import afabric
from afabric import errors

SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def _recrc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.fixture(scope="module")
def samples() -> tuple[bytes, bytes]:
    """A real descriptor and address (from a live engine) to mutate."""

    async def make() -> tuple[bytes, bytes]:
        async with afabric.Engine("tcp") as eng:
            mr = eng.register(np.zeros(64, dtype=np.uint8))
            return bytes(mr.descriptor), bytes(eng.address)

    return asyncio.run(make())


@SETTINGS
@given(blob=st.binary(max_size=600))
def test_random_bytes_never_crash_the_decoders(blob: bytes) -> None:
    for cls in (afabric.MrDesc, afabric.Address):
        with contextlib.suppress(errors.BadDescriptor):
            cls.from_bytes(blob)


@SETTINGS
@given(data=st.data())
def test_mutated_blobs_with_valid_checksums(samples: tuple[bytes, bytes], data: st.DataObject) -> None:
    """Past the checksum: mutations an attacker could make still decode or fail cleanly."""
    for blob, cls in ((samples[0], afabric.MrDesc), (samples[1], afabric.Address)):
        body = bytearray(blob[:-4])
        for _ in range(data.draw(st.integers(1, 4))):
            op = data.draw(st.sampled_from(["flip", "cut", "grow", "field"]))
            if op == "flip" and body:
                i = data.draw(st.integers(0, len(body) - 1))
                body[i] ^= data.draw(st.integers(1, 255))
            elif op == "cut" and body:
                del body[data.draw(st.integers(0, len(body) - 1)) :]
            elif op == "grow":
                body += data.draw(st.binary(min_size=1, max_size=32))
            elif op == "field" and len(body) >= 8:
                i = data.draw(st.integers(4, len(body) - 4))
                body[i : i + 4] = struct.pack("<I", data.draw(st.sampled_from([0, 1, 255, 2**31, 2**32 - 1])))
        try:
            obj = cls.from_bytes(_recrc(bytes(body)))
        except errors.BadDescriptor:
            continue
        assert bytes(obj) == _recrc(bytes(body))  # whatever decodes round-trips


async def test_write_arguments_are_checked(samples: tuple[bytes, bytes]) -> None:
    """Random lengths, offsets and immediates: a typed error and nothing posted, or a write
    that lands exactly where it was asked to."""
    rng = random.Random(20261130)  # one engine pair for all draws: seeded, not @given

    def u64() -> int:
        pick = rng.random()
        if pick < 0.7:
            return rng.randint(0, 300)
        if pick < 0.9:
            return rng.randint(-(2**64), 2**65)
        return rng.choice([2**32, 2**63, 2**64 - 1, -1])

    def imm() -> int | None:
        return None if rng.random() < 0.4 else rng.choice([rng.randint(0, 2**32 - 1), -1, 2**32, 2**40])

    async with afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        dst = np.zeros(256, dtype=np.uint8)
        rmr = b.register(dst)
        smr = a.register(np.arange(256, dtype=np.uint8))
        for _ in range(300):
            length, src_off, dst_off, value = u64(), u64(), u64(), imm()
            dst[:] = 0
            ok = (
                length >= 0
                and src_off >= 0
                and dst_off >= 0
                and src_off + length <= 256
                and dst_off + length <= 256
            )
            ok = ok and (value is None or 0 <= value < 2**32)
            try:
                await a.write(smr, rmr.descriptor, length, src_offset=src_off, dst_offset=dst_off, imm=value)
            except (errors.InvalidArgument, errors.OutOfRange, errors.ImmediateOutOfRange):
                assert not ok, (length, src_off, dst_off, value)
                assert not dst.any()
                continue
            assert ok, (length, src_off, dst_off, value)
            if value is not None:
                await b.expect_imm(value, 1, timeout=10)
            want = np.zeros(256, dtype=np.uint8)
            want[dst_off : dst_off + length] = np.arange(256, dtype=np.uint8)[src_off : src_off + length]
            assert np.array_equal(dst, want)


def _spans_disjoint(spans: list[tuple[int, int]]) -> bool:
    ends = sorted((s, s + n) for s, n in spans if n)
    return all(x[1] <= y[0] for x, y in itertools.pairwise(ends))


SIZE = 1024
SOURCE = np.random.default_rng(5).integers(1, 256, SIZE, dtype=np.uint8)


async def _paged_draw(
    rng: random.Random, a: afabric.Engine, smr: afabric.MemoryRegion, desc: afabric.MrDesc, dst: np.ndarray
) -> bool:
    """One random paged write; True if it was accepted (and wrote exactly what it asked)."""
    n = rng.randint(0, 5)
    plen = rng.choice([0, 1, 16, 16, 64, 64, 200, 2048, -1])
    sides = []
    for _side in range(2):
        idx = [rng.randint(0, 7) if rng.random() < 0.95 else rng.choice([-1, 40]) for _ in range(n)]
        if rng.random() < 0.05:
            idx.append(0)  # one side longer than the other
        stride = rng.choice([64, 64, 100, 16, 1, 0, -4])
        sides.append((idx, stride, rng.choice([0, 0, 3, 64, 1000, -1])))
    try:
        src_pages, dst_pages = (afabric.Pages(np.array(i, dtype=np.int64), s, o) for i, s, o in sides)
        await a.write_paged(smr, desc, page_len=plen, src_pages=src_pages, dst_pages=dst_pages)
    except errors.InvalidArgument:
        assert not dst.any(), "a refused paged write wrote something"
        return False
    (sidx, sstr, soff), (didx, dstr, doff) = sides
    assert len(sidx) == len(didx) and plen >= 0 and sstr > 0 and dstr > 0
    src_spans = [(soff + i * sstr, plen) for i in sidx]
    dst_spans = [(doff + i * dstr, plen) for i in didx]
    assert all(s >= 0 and s + plen <= SIZE for s, _ in src_spans + dst_spans), sides
    if _spans_disjoint(dst_spans):  # else the unordered contract leaves the overlap open
        want = np.zeros(SIZE, dtype=np.uint8)
        for (s, _), (d, _) in zip(src_spans, dst_spans, strict=True):
            want[d : d + plen] = SOURCE[s : s + plen]
        assert np.array_equal(dst, want), sides
    return True


async def _scatter_draw(
    rng: random.Random, a: afabric.Engine, smr: afabric.MemoryRegion, desc: afabric.MrDesc, dst: np.ndarray
) -> bool:
    """One random scatter; True if it was accepted (and wrote exactly what it asked)."""

    def small() -> int:
        if rng.random() < 0.8:
            return rng.choice([0, 1, 7, 64, 100, 255, 256])
        return rng.choice([512, 1000, 1024, 1025, 2**40, 2**64 - 1])

    rows = [(small(), small(), small()) for _ in range(rng.randint(1, 4))]
    fits = all(s + n <= SIZE and d + n <= SIZE for n, s, d in rows)
    try:
        await a.scatter(smr, [afabric.ScatterTarget(desc, n, s, d) for n, s, d in rows])
    except errors.InvalidArgument:
        assert not dst.any(), "a refused scatter wrote something"
        assert not fits, rows
        return False
    assert fits, rows
    if _spans_disjoint([(d, n) for n, _, d in rows]):
        want = np.zeros(SIZE, dtype=np.uint8)
        for n, s, d in rows:
            want[d : d + n] = SOURCE[s : s + n]
        assert np.array_equal(dst, want), rows
    return True


@pytest.mark.parametrize("kind", ["paged", "scatter"])
async def test_paged_and_scatter_arguments_are_checked(kind: str) -> None:
    """Random page lists and scatter targets: a typed error (an InvalidArgument) with
    nothing written, or an operation that wrote exactly what was asked for. Seeded draws
    over one engine pair, like the write test above."""
    rng = random.Random(20261201)
    draw = _paged_draw if kind == "paged" else _scatter_draw
    async with afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        dst = np.zeros(SIZE, dtype=np.uint8)
        desc = b.register(dst).descriptor
        smr = a.register(SOURCE.copy())
        accepted = 0
        for _ in range(150):
            dst[:] = 0
            accepted += await draw(rng, a, smr, desc, dst)
        assert 10 < accepted < 140, accepted  # both outcomes drawn often enough to mean something


async def test_message_sizes_are_checked() -> None:
    """Around the smaller of the two engines' message sizes and up to the receiver's
    max_queued_bytes: delivery of exactly the bytes sent (in fragments above one receive
    buffer); above max_queued_bytes MessageTooLarge, before any fragment is sent."""
    big = 1 << 26
    async with (
        afabric.Engine("tcp", max_message_size=1 << 20) as a,
        afabric.Engine("tcp", max_queued_bytes=big) as b,
    ):
        limit = min(a.max_message_size, b.max_message_size)
        for n in (0, 1, limit - 1, limit, limit + 1, 2 * limit, big):
            await a.send(b.address, bytes(n))
            assert len(await asyncio.wait_for(b.recv_bytes(), 10)) == n
        with pytest.raises(errors.MessageTooLarge, match="at most"):
            await a.send(b.address, bytes(big + 1))
