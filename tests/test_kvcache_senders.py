"""KV-cache control messages act only for the engine that sent them, between real
processes over real providers (tcp, shm; cma where cheap): a third engine that sends
CANCEL, RELEASE, CONFIRM, READY or heartbeats in another engine's name is ignored and
counted, the genuine transfer completes bit-exact, and a silent peer is declared dead
however many heartbeats others send for it. Request ids are 64 random bits, so nobody can
name another decoder's request by counting."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

import numpy as np
import pytest

import afabric
from afabric.kvcache import KvCacheLayout, Prefiller, PrefillJob, RequestFailed, State, wire
from afabric.kvcache.peers import Peers
from afabric.kvcache.views import store_layer
from afabric.messages import TAG_KVCACHE, Message

from .conftest import WITH_CMA
from .procs import Ctl, Peer
from .test_kvcache import (
    DEAD,
    HB,
    LAYOUT,
    PAGES,
    SLOW,
    check_landed,
    decoder,
    kv_for,
    seed_of,
    tail_for,
    until,
)


async def gated_prefill_proc(ctl: Ctl, provider: str, dead: float) -> dict[str, int]:
    """A prefiller whose model computes nothing until told "go"; answers "state" with its
    bookkeeping (forged and bad message counts included) until told "stop"."""
    lay = KvCacheLayout(**LAYOUT)
    async with afabric.Engine(provider, op_timeout=20.0) as eng:
        cache = np.zeros(lay.shape(), dtype=np.float16)
        async with Prefiller(eng, lay, cache=cache, heartbeat_interval=HB, peer_timeout=dead) as pf:
            gate = asyncio.Event()

            async def compute(job: PrefillJob) -> None:
                await gate.wait()
                seed = seed_of(job.payload)
                for layer in range(lay.num_layers):
                    store_layer(cache, layer, job.first_page, kv_for(seed, layer, job.num_tokens, lay))
                    job.layer_done()
                job.tail[:] = tail_for(seed, lay)
                job.tail_done()

            def report() -> dict[str, int]:
                return {
                    "active": len(pf.active), "free_pages": pf.allocator.free_pages,
                    "forged": pf.forged_messages, "bad": pf.bad_messages, **pf.stats,
                }  # fmt: skip

            server = asyncio.ensure_future(pf.serve(compute))
            ctl.put(bytes(eng.address))
            while (cmd := await ctl.get(timeout=300)) != "stop":
                if cmd == "go":
                    gate.set()
                    ctl.put("ok")
                else:
                    assert cmd == "state"
                    ctl.put(report())
            for _ in range(3000):  # at most 30 s: the last job's local completions
                if not pf.active:
                    break
                await asyncio.sleep(0.01)
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server
            return report()


def start_gated(peers: list[Peer], provider: str, dead: float = SLOW) -> Peer:
    p = Peer(gated_prefill_proc, provider, dead)
    peers.append(p)
    return p


async def ask(p: Peer, cmd: str) -> Any:
    p.put(cmd)
    return await p.get()


async def until_state(p: Peer, cond: Any, timeout: float, what: str) -> dict[str, int]:
    t0 = time.monotonic()
    while True:
        st = await ask(p, "state")
        if cond(st):
            return st
        assert time.monotonic() - t0 < timeout, f"not within {timeout} s: {what}: {st}"
        await asyncio.sleep(0.05)


async def ksend(eng: afabric.Engine, to: Any, msg: bytes) -> None:
    await eng.send(to, msg, tag=TAG_KVCACHE)


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_a_prefiller_ignores_cancel_release_and_heartbeats_in_a_decoders_name(
    provider: str, peers: list[Peer]
) -> None:
    p = start_gated(peers, provider)
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider) as eng, afabric.Engine(provider) as third:
        dec, cache = decoder(eng)
        async with dec:
            r = await dec.submit(addr, 100, payload=(3).to_bytes(8, "little"))
            await until_state(p, lambda s: s["active"] == 1, 30, "the request accepted")
            victim = bytes(eng.address)
            for msg in (
                wire.encode_cancel(victim, r.request_id),
                wire.encode_release(victim, r.request_id),
                wire.encode_heartbeat(victim, wire.DECODER, 1),
            ):
                await ksend(third, addr, msg)
            st = await until_state(p, lambda s: s["forged"] >= 3, 30, "the forged messages counted")
            assert st["active"] == 1 and st.get("cancelled", 0) == 0, st
            assert r.state == State.PENDING
            assert await ask(p, "go") == "ok"
            await r.wait(timeout=60)
            check_landed(dec, cache, r, 3)
            r.release()
            assert dec.forged_messages == 0
    p.put("stop")
    st = await p.result()
    assert st["done"] == 1 and st["forged"] == 3 and st["bad"] == 0 and st.get("cancelled", 0) == 0, st
    assert st["free_pages"] == PAGES


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_a_decoder_ignores_confirm_ready_and_heartbeats_in_a_prefillers_name(
    provider: str, peers: list[Peer]
) -> None:
    """A failure CONFIRM for a push request and a READY for a pull request (pointing at the
    third engine's own readable memory, of the right geometry) in the prefiller's name do
    nothing: both requests land bit-exact from the real prefiller once it computes."""
    lay = KvCacheLayout(**LAYOUT)
    p = start_gated(peers, provider)
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider) as eng, afabric.Engine(provider) as third:
        junk = np.full(lay.total_bytes, 0x5A, dtype=np.uint8)
        junk_mr = third.register(junk, remote="r")
        junk_tail = third.register(np.full(lay.tail_region_bytes, 0x5A, dtype=np.uint8), remote="r")
        jdesc, jtail = bytes(junk_mr.descriptor or b""), bytes(junk_tail.descriptor or b"")
        dec, cache = decoder(eng)
        async with dec:
            push = await dec.submit(addr, 60, payload=(4).to_bytes(8, "little"))
            pull = await dec.submit(addr, 40, payload=(5).to_bytes(8, "little"), mode="pull")
            await until_state(p, lambda s: s["active"] == 2, 30, "both requests accepted")
            name = bytes(addr)
            forged = [
                wire.encode_confirm(name, push.request_id, wire.FAILED, 0, "forged"),
                wire.encode_confirm(name, pull.request_id, wire.CANCELLED, 0, "forged"),
                wire.encode_ready(name, pull.request_id, PAGES, 0, jdesc, jtail, 0),
                wire.encode_heartbeat(name, wire.PREFILLER, 1),
            ]
            for msg in forged:
                await ksend(third, eng.address, msg)
            await until(lambda: dec.forged_messages >= len(forged), 30, "the forged messages counted")
            assert push.state == pull.state == State.PENDING
            assert all(k.reading is None for k in pull.ranks), "a forged READY was read"
            assert "sent by" in dec.last_forged_message
            assert await ask(p, "go") == "ok"
            for seed, r in ((4, push), (5, pull)):
                await r.wait(timeout=60)
                check_landed(dec, cache, r, seed)
                r.release()
            assert dec.forged_messages == len(forged) and dec.bad_messages == 0
    p.put("stop")
    st = await p.result()
    assert st["done"] == 2 and st["forged"] == 0, st


async def test_heartbeats_in_a_silent_prefillers_name_keep_it_dead(provider: str) -> None:
    """The 'prefiller' is an engine that never answers; a third engine sends heartbeats in
    its name all along: the decoder still declares it dead after peer_timeout."""
    async with (
        afabric.Engine(provider) as eng,
        afabric.Engine(provider) as silent,
        afabric.Engine(provider) as third,
    ):  # fmt: skip
        dec, _cache = decoder(eng, dead=DEAD)
        async with dec:
            r = await dec.submit(silent.address, 50, payload=(6).to_bytes(8, "little"))
            name = bytes(silent.address)

            async def beat() -> None:
                for seq in range(1, 10**6):
                    await ksend(third, eng.address, wire.encode_heartbeat(name, wire.PREFILLER, seq))
                    await asyncio.sleep(HB / 2)

            beating = asyncio.ensure_future(beat())
            try:
                with pytest.raises(RequestFailed, match="silent"):
                    await r.wait(timeout=DEAD + 20)
            finally:
                beating.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await beating
            assert dec.forged_messages >= 1
            await until(lambda: not dec.requests, 20, "pages freed")


async def test_heartbeats_in_a_silent_decoders_name_keep_it_dead(provider: str, peers: list[Peer]) -> None:
    """A 'decoder' asks for a pull by hand and then says nothing (its pages stay held); a
    third engine sends heartbeats in its name all along: the prefiller still declares it
    dead after peer_timeout and frees the pages."""
    lay = KvCacheLayout(**LAYOUT)
    p = start_gated(peers, provider, dead=DEAD)
    addr = afabric.Address.from_bytes(await p.get())
    assert await ask(p, "go") == "ok"
    async with afabric.Engine(provider) as quiet, afabric.Engine(provider) as third:
        mine = quiet.register(np.zeros(lay.total_bytes, dtype=np.uint8))
        n = lay.pages_for(40)
        req = wire.Request(
            77, lay.fingerprint(), lay.num_pages, 40, 3, False, 0, bytes(mine.descriptor or b""), b"",
            np.array([[0, 0, n]], dtype=np.int64), (7).to_bytes(8, "little"), pull=True,
        )  # fmt: skip
        name = bytes(quiet.address)
        for frag in wire.encode_request(name, req, quiet.max_message_size):
            await ksend(quiet, addr, frag)
        await until_state(p, lambda s: s.get("ready", 0) == 1, 30, "the pages held")

        async def beat() -> None:
            for seq in range(1, 10**6):
                await ksend(third, addr, wire.encode_heartbeat(name, wire.DECODER, seq))
                await asyncio.sleep(HB / 2)

        beating = asyncio.ensure_future(beat())
        try:
            st = await until_state(
                p, lambda s: s["active"] == 0 and s["free_pages"] == PAGES, DEAD + 20, "the decoder dead"
            )
        finally:
            beating.cancel()
            with pytest.raises(asyncio.CancelledError):
                await beating
        assert st.get("dead_decoders", 0) == 1 and st["forged"] >= 1, st
    p.put("stop")
    await p.result()


async def test_request_ids_are_64_random_bits(provider: str, peers: list[Peer]) -> None:
    p = start_gated(peers, provider)
    addr = afabric.Address.from_bytes(await p.get())
    assert await ask(p, "go") == "ok"
    ids: list[int] = []
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            for batch in range(8):
                reqs = [
                    await dec.submit(addr, 1, payload=(100 + 8 * batch + i).to_bytes(8, "little"))
                    for i in range(8)
                ]
                for i, r in enumerate(reqs):
                    await r.wait(timeout=60)
                    check_landed(dec, cache, r, 100 + 8 * batch + i)
                    r.release()
                ids += [r.request_id for r in reqs]
    p.put("stop")
    assert (await p.result())["done"] == len(ids)
    assert len(set(ids)) == len(ids) and all(0 <= i < 1 << 64 for i in ids)
    # a counter (or any short step) shows in consecutive differences; random ids differ by
    # more than 2**32 except with probability 2**-32 per pair
    steps = [abs(b - a) for a, b in itertools.pairwise(ids)]
    assert sum(s < 1 << 32 for s in steps) <= 1, steps
    # every one of the 64 bits varies over 64 ids (a constant bit: probability 2**-57 in all)
    for bit in range(64):
        assert len({(i >> bit) & 1 for i in ids}) == 2, f"bit {bit} is the same in all {len(ids)} ids"


async def test_an_unverified_claim_of_a_verified_peer_is_refused() -> None:
    """The rule for what the provider cannot vouch for (Message.verified False): taken when
    it names its transport sender, unless that peer's messages came verified before (the
    provider names it, so this one is someone else's), request fragments excepted (they
    may travel as large messages, checked when announced)."""
    async with afabric.Engine("tcp") as eng, afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        peers = Peers(eng, wire.PREFILLER, logging.getLogger("test"))
        ab, bb = bytes(a.address), bytes(b.address)
        beat_a = wire.parse(wire.encode_heartbeat(ab, wire.DECODER, 1))
        beat_b = wire.parse(wire.encode_heartbeat(bb, wire.DECODER, 1))
        frag = wire.parse(wire.encode_request(ab, _tiny_request(), 4096)[0])
        cancel = wire.parse(wire.encode_cancel(ab, 5))

        def msg(sender: afabric.Address, verified: bool) -> Message:
            return Message(b"", sender, TAG_KVCACHE, verified)

        assert "sent by" in peers.impostor(beat_a, msg(b.address, True))  # names another
        assert peers.impostor(beat_a, msg(a.address, False)) == ""  # never vouched: taken
        assert peers.impostor(beat_a, msg(a.address, True)) == ""
        assert "vouch" in peers.impostor(cancel, msg(a.address, False))
        assert "vouch" in peers.impostor(beat_a, msg(a.address, False))
        assert peers.impostor(frag, msg(a.address, False)) == ""
        assert peers.impostor(beat_b, msg(b.address, False)) == ""  # b: still never vouched


def _tiny_request() -> wire.Request:
    lay = KvCacheLayout(**LAYOUT)
    return wire.Request(
        9, lay.fingerprint(), lay.num_pages, 8, 3, False, 0, b"d", b"", np.array([[0, 0, 1]], dtype=np.int64)
    )
