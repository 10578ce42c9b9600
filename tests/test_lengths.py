"""Writes whose length is read from memory when they start (``length_from``), between two
real processes over tcp and shm: the bytes the word asks for land and not one byte more,
the word is read when the trigger fires (not when the write was armed), an empty result
still delivers its immediate, a length word past the maximum is clamped to it, and bad
length words are refused before anything is posted."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import afabric
from afabric import LengthFrom, errors

from .procs import Ctl, Peer

MAX = 4096
SLOTS = 4
SENTINEL = 0xEE


async def _target(ctl: Ctl, provider: str) -> bool:
    async with afabric.Engine(provider) as eng:
        buf = np.full(SLOTS * MAX, SENTINEL, dtype=np.uint8)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm))
        await eng.expect_imm(imm, SLOTS, timeout=60)
        ctl.put(buf.tobytes())
        assert await ctl.get() == "close"
        return True


@pytest.mark.timeout(120)
async def test_length_from_memory(provider: str, peers: list[Peer]) -> None:
    p = Peer(_target, provider)
    peers.append(p)
    desc_b, imm = await p.get()
    desc = afabric.MrDesc.from_bytes(desc_b)
    src = ((np.arange(SLOTS * MAX) * 7 + 3) % 251).astype(np.uint8)
    words = np.zeros(16, dtype=np.uint32)
    async with afabric.Engine(provider) as eng:
        mr = eng.register(src, remote=False)
        lw = eng.register(words, remote=False)
        w = eng.uvm_watcher()
        # slot 0: armed while the word says 1, fired after it says 5: 16 + 5*100 bytes
        words[0] = 1
        armed = asyncio.ensure_future(
            eng.write(mr, desc, MAX, 0, 0, imm=imm, when=w.reaches(1),
                      length_from=LengthFrom(lw, 0, scale=100, base=16))
        )  # fmt: skip
        await asyncio.sleep(0.05)
        assert not armed.done()
        words[0] = 5
        w.add(1)
        await asyncio.wait_for(armed, 30)
        # slot 1: a negative base past the count: empty, only the immediate arrives
        words[1] = 2
        await eng.write(mr, desc, MAX, MAX, MAX, imm=imm, length_from=LengthFrom(lw, 4, scale=8, base=-64))
        # slot 2: a word asking for more than the maximum is clamped to it
        words[2] = 0xFFFFFFFF
        await eng.write(mr, desc, 1000, 2 * MAX, 2 * MAX, imm=imm, length_from=LengthFrom(lw, 8, scale=3))
        # slot 3: scale 1 reads a byte count
        words[3] = 777
        await eng.write(mr, desc, MAX, 3 * MAX, 3 * MAX, imm=imm, length_from=LengthFrom(lw, 12))
        # bad length words: refused at the call, nothing posted
        with pytest.raises(errors.InvalidArgument):
            LengthFrom(lw, 2)
        with pytest.raises(errors.AfabricError):
            await eng.write(mr, desc, MAX, 0, 0, length_from=LengthFrom(lw, 64))
        with pytest.raises(errors.InvalidArgument):
            await eng.write(mr, desc, MAX, 0, 0, length_from=(lw, 0))  # type: ignore[arg-type]
        async with afabric.Engine(provider) as other:
            foreign = other.register(np.zeros(4, dtype=np.uint32), remote=False)
            with pytest.raises(errors.AfabricError):
                await eng.write(mr, desc, MAX, 0, 0, length_from=LengthFrom(foreign, 0))
        got = np.frombuffer(await p.get(), dtype=np.uint8).reshape(SLOTS, MAX)
        p.put("close")
        assert await p.result() is True
    want_lengths = (16 + 5 * 100, 0, 1000, 777)
    for slot, n in enumerate(want_lengths):
        row = got[slot]
        assert np.array_equal(row[:n], src[slot * MAX : slot * MAX + n]), f"slot {slot}: wrong bytes"
        assert (row[n:] == SENTINEL).all(), f"slot {slot}: bytes past {n} were written"
