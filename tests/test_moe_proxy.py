"""The MoE host proxy's protocol between two real processes, without a GPU: each process
plays its send kernel with the CPU (fills its send slots, bumps the watcher word) and its
receive kernel (waits for the flag word, checks the slot).

Per call it checks that nothing is posted before the bump (the flag stays below the call's
epoch and the receive slot keeps the previous call's bytes), that after the bump the flag
reaches the epoch only once every phase has landed (the private part and the rest, with
``max_private_tokens`` < ``max_tokens``), that the bytes land in this rank's slot of the
right parity at the peer, and the same for combine's partial sums. The token count in the
slot's header varies per call (0, below, at and above ``max_private_tokens``, all of
``max_tokens``): exactly the header, routes and that many rows arrive (combine: that many
rows of partial sums), and not one byte past them."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from afabric.moe import MoeConfig
from afabric.moe.proxy import Proxy

from .procs import Ctl, Peer

CFG = dict(max_tokens=12, num_experts=8, experts_per_token=3, hidden=64, world_size=2, in_dtype="fp8",
           scale_block=32, max_private_tokens=5)  # fmt: skip
CALLS = 5  # both parities, each slot reused


def _count(epoch: int, rank: int) -> int:
    """Tokens a rank sends in call ``epoch``: over the calls 12, 2, 5, 8, 11 and 4, 7, 10, 0, 3."""
    return (3 * epoch + 5 * rank + 9) % (CFG["max_tokens"] + 1)  # type: ignore[operator]


def _pattern(n: int, epoch: int, rank: int, salt: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return ((np.arange(n, dtype=np.int64) * 7 + epoch * 13 + rank * 101 + salt) % 251).astype(np.uint8)


def _landed(what: str, got: Any, want: Any, before: Any, n: int) -> None:
    """The first ``n`` bytes are the sender's, the rest what was there before."""
    assert np.array_equal(got[:n], want[:n]), f"{what}: wrong bytes"
    assert np.array_equal(got[n:], before[n:]), f"{what}: bytes past {n} moved"


async def _wait_word(words: np.ndarray[Any, Any], i: int, value: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while int(words[i]) < value:
        if time.monotonic() > deadline:
            raise AssertionError(f"flag word {i} stuck at {int(words[i])}, waiting for {value}")
        await asyncio.sleep(0.001)


async def _writes(px: Proxy) -> dict[str, int]:
    return {n["transport"]: n["writes"] for n in px.eng.stats()["nics"]}


async def _rank(ctl: Ctl, rank: int, provider: str) -> dict[str, int]:
    """One rank's calls; returns the writes its proxy's engine posted, per transport."""
    cfg = MoeConfig(**CFG)  # type: ignore[arg-type]
    peer = 1 - rank
    px = Proxy(cfg, rank, [peer], provider, tag=3, device=None)
    try:
        assert px.phases == 2
        ctl.put(px.descs())
        px.connect({peer: await ctl.get()})
        regions = (px.dsend, px.drecv, px.csend, px.crecv, px.flags)
        dsend, drecv, csend, crecv, flags_b = (r.array for r in regions)
        assert dsend is not None and drecv is not None and csend is not None and crecv is not None
        assert flags_b is not None
        flags = flags_b.view(np.uint64)
        lay = cfg.slot_layout()
        dlen = lay.private_bytes(cfg.max_tokens)
        clen = px.cslot
        crow = cfg.hidden * cfg.out_itemsize
        for s in range(1, CALLS + 1):
            p = s & 1
            mine = slice((p * 2 + peer) * px.dslot, (p * 2 + peer) * px.dslot + dlen)
            theirs = slice((p * 2 + peer) * px.dslot, (p * 2 + peer) * px.dslot + dlen)
            cmine = slice((p * 2 + peer) * clen, (p * 2 + peer + 1) * clen)
            sent = _pattern(dlen, s, rank, 0)
            sent[:4] = np.frombuffer(np.int32(_count(s, rank)).tobytes(), dtype=np.uint8)
            dsend[mine] = sent
            csend[cmine] = _pattern(clen, s, rank, 1)
            before = drecv[theirs].copy()
            cbefore = crecv[cmine].copy()
            px.arm_dispatch(s)
            px.arm_combine(s)
            ctl.put(("armed", s))
            assert await ctl.get() == ("quiet?", s)
            await asyncio.sleep(0.05)  # armed, not bumped: nothing may move
            assert int(flags[0]) < s and int(flags[1]) < s, (int(flags[0]), int(flags[1]), s)
            assert np.array_equal(drecv[theirs], before), "data arrived before the watcher bump"
            ctl.put(("quiet", s))
            assert await ctl.get() == ("bump", s)
            assert px.w_dispatch.add(1) == s
            await _wait_word(flags, 0, s)
            want = _pattern(dlen, s, peer, 0)
            want[:4] = np.frombuffer(np.int32(_count(s, peer)).tobytes(), dtype=np.uint8)
            _landed(f"dispatch {s}", drecv[theirs], want, before, lay.private_bytes(_count(s, peer)))
            assert px.w_combine.add(1) == s
            await _wait_word(flags, 1, s)
            # partial sums for the tokens this rank sent the peer
            _landed(f"combine {s}", crecv[cmine], _pattern(clen, s, peer, 1), cbefore, _count(s, rank) * crow)
            px.raise_errors()
            ctl.put(("done", s))
        # like AllToAll.close: nobody closes before every rank has received everything (a
        # write this rank fired may still be on its way to the peer)
        assert await ctl.get() == "close"
        return px._call(_writes(px))  # (the engine is the proxy loop's)
    finally:
        px.close()


async def run_protocol(ranks: list[Peer]) -> list[dict[str, int]]:
    """Drive two :func:`_rank` peers through the calls; their results."""
    descs = [await p.get() for p in ranks]
    ranks[0].put(descs[1])
    ranks[1].put(descs[0])
    for s in range(1, CALLS + 1):
        for step, reply in (("armed", "quiet?"), ("quiet", "bump")):
            for p in ranks:
                assert await p.get() == (step, s)
            for p in ranks:
                p.put((reply, s))
        for p in ranks:
            assert await p.get() == ("done", s)
    for p in ranks:
        p.put("close")
    return [await p.result() for p in ranks]


@pytest.mark.timeout(120)
async def test_proxy_protocol(provider: str, peers: list[Peer]) -> None:
    ranks = [Peer(_rank, r, provider) for r in range(2)]
    peers.extend(ranks)
    for writes in await run_protocol(ranks):
        assert writes[provider] > 0


def test_imm_values_are_distinct() -> None:
    """Immediates of the two directions, of successive calls and of two instances (tags)
    never collide within the window a host may run ahead."""
    from afabric.moe.proxy import EPOCH_RING

    class _P:  # imm() needs only the tag
        imm = Proxy.imm

        def __init__(self, tag: int) -> None:
            self.tag = tag

    seen = set()
    for tag in (0, 1, 32767):
        for direction in (0, 1):
            for epoch in (1, 2, EPOCH_RING - 1):
                v = _P(tag).imm(direction, epoch)  # type: ignore[misc]
                assert 0 <= v <= 0xFFFFFFFF and v not in seen
                seen.add(v)
