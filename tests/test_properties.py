"""Property-based checks of everything that parses bytes from a peer or a user, and of the
write path's argument checks: any input gives a result or a typed error, never a crash,
and a refused write posts nothing."""

from __future__ import annotations

import asyncio
import contextlib
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
