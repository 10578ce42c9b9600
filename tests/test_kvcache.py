"""KV-cache transfer between real processes over real providers (tcp, shm): concurrent
requests land bit-exact, cancellation is confirmed before pages are reused (canary
checks), dead peers are detected both ways, malformed requests are refused without
touching the others, replicated caches are filled by several prefillers."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import afabric
from afabric.kvcache import (
    Decoder,
    KvCacheLayout,
    Prefiller,
    PrefillJob,
    ProtocolError,
    RequestFailed,
    RequestRejected,
    State,
    wire,
)
from afabric.kvcache.views import gather_layer, store_layer
from afabric.messages import TAG_KVCACHE

from .conftest import libfabric_version
from .procs import Ctl, Peer

PAGES = 128
# heartbeat interval and peer timeouts (s): DEAD where a test kills a peer (short, and still
# far above what a loaded 2-core box stalls for), SLOW elsewhere (no false alarm, ever)
HB, DEAD, SLOW = 0.2, 3.0, 30.0
LAYOUT: dict[str, Any] = {
    "num_layers": 6, "num_kv_heads": 2, "head_dim": 16, "dtype": "float16", "tokens_per_page": 8,
    "num_pages": PAGES, "tail_bytes": 64, "tail_slots": 16,
}  # fmt: skip
MLA: dict[str, Any] = {**LAYOUT, "parts": 1, "num_kv_heads": 1, "head_dim": 32}


def kv_for(seed: int, layer: int, tokens: int, lay: KvCacheLayout) -> np.ndarray:
    """The 'model': a request's KV for one layer, a function of its seed (its payload)."""
    rng = np.random.default_rng(seed * 1009 + layer)
    return rng.standard_normal((lay.parts, lay.num_kv_heads, tokens, lay.head_dim)).astype(np.float16)


def tail_for(seed: int, lay: KvCacheLayout) -> np.ndarray:
    return np.random.default_rng(seed + 77).integers(0, 256, lay.tail_bytes, dtype=np.uint8)


def seed_of(payload: bytes) -> int:
    return int.from_bytes(payload[:8], "little")


# ---- the prefill process ----


async def prefill_proc(
    ctl: Ctl, provider: str, layout_kw: dict[str, Any], staging_pages: int, delay: float, op_timeout: float,
    dead: float, bind: str | None = None,
) -> dict[str, int]:  # fmt: skip
    """A prefiller whose model takes ``delay`` s per layer; answers "state" with its
    bookkeeping until told "stop"."""
    lay = KvCacheLayout(**layout_kw)
    stage = lay.with_pages(staging_pages)
    async with afabric.Engine(provider, op_timeout=op_timeout, bind=bind) as eng:
        cache = np.zeros(stage.shape(), dtype=np.float16)
        async with Prefiller(eng, stage, cache=cache, heartbeat_interval=HB, peer_timeout=dead) as pf:
            loop = asyncio.get_running_loop()

            def work(job: PrefillJob) -> None:
                seed = seed_of(job.payload)
                for layer in range(lay.num_layers):
                    store_layer(cache, layer, job.first_page, kv_for(seed, layer, job.num_tokens, lay))
                    time.sleep(delay)
                    job.layer_done()
                job.tail[:] = tail_for(seed, lay)
                job.tail_done()

            async def compute(job: PrefillJob) -> None:
                await loop.run_in_executor(None, work, job)

            server = asyncio.ensure_future(pf.serve(compute))
            ctl.put(bytes(eng.address))
            while (cmd := await ctl.get(timeout=300)) != "stop":
                assert cmd == "state"
                ctl.put({
                    "active": len(pf.active), "free_pages": pf.allocator.free_pages,
                    "bad": pf.bad_messages, **pf.stats,
                })  # fmt: skip
            # the decoder saw every immediate; this side may still be finishing the last
            # job's bookkeeping (its writes' local completions come after the target's)
            for _ in range(3000):  # at most 30 s
                if not pf.active:
                    break
                await asyncio.sleep(0.01)
            server.cancel()
            with pytest.raises(asyncio.CancelledError):
                await server
            return {"bad": pf.bad_messages, "free_pages": pf.allocator.free_pages, **pf.stats}


def start_prefiller(
    peers: list[Peer], provider: str, layout: dict[str, Any] = LAYOUT, staging: int = PAGES,
    delay: float = 0.0, op_timeout: float = 20.0, dead: float = SLOW,
) -> Peer:  # fmt: skip
    p = Peer(prefill_proc, provider, layout, staging, delay, op_timeout, dead)
    peers.append(p)
    return p


async def state(p: Peer) -> dict[str, int]:
    p.put("state")
    out: dict[str, int] = await p.get()
    return out


# ---- decoder-side checks ----


def decoder(
    eng: afabric.Engine, layout: dict[str, Any] = LAYOUT, dead: float = SLOW
) -> tuple[Decoder, np.ndarray]:
    lay = KvCacheLayout(**layout)
    cache = np.zeros(lay.shape(), dtype=np.float16)
    return Decoder(eng, lay, cache=cache, heartbeat_interval=HB, peer_timeout=dead, drain_timeout=10), cache


def check_landed(dec: Decoder, cache: np.ndarray, req: Any, seed: int) -> None:
    lay = dec.layout
    for layer in range(lay.num_layers):
        got = gather_layer(cache, layer, req.pages, req.num_tokens)
        want = kv_for(seed, layer, req.num_tokens, lay)
        assert np.array_equal(got.view(np.uint16), want.view(np.uint16)), (
            f"request {req.request_id} layer {layer}"
        )
    assert np.array_equal(np.asarray(req.tail), tail_for(seed, lay))


def layer_landed(cache: np.ndarray, req: Any, layer: int, seed: int, lay: KvCacheLayout) -> bool:
    got = gather_layer(cache, layer, req.pages, req.num_tokens)
    return bool(np.array_equal(got.view(np.uint16), kv_for(seed, layer, req.num_tokens, lay).view(np.uint16)))


async def until(cond: Any, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        await asyncio.sleep(0.005)


CANARY = np.uint16(0xBEEF)


def paint(cache: np.ndarray, pages: np.ndarray) -> None:
    """Write the canary into every block of ``pages`` (all layers, parts, heads)."""
    cache.view(np.uint16)[:, :, :, pages] = CANARY


def painted(cache: np.ndarray, pages: np.ndarray) -> bool:
    return bool((cache.view(np.uint16)[:, :, :, pages] == CANARY).all())


# ---- tests ----


@pytest.mark.both_loops
async def test_concurrent_requests_land_bit_exact(provider: str, peers: list[Peer]) -> None:
    p = start_prefiller(peers, provider)
    addr = afabric.Address.from_bytes(await p.get())
    lengths = [1, 8, 9, 64, 100, 250, 333]
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            reqs = await asyncio.gather(
                *(dec.submit(addr, n, payload=(i + 1).to_bytes(8, "little")) for i, n in enumerate(lengths))
            )
            await asyncio.gather(*(r.wait(timeout=60) for r in reqs))
            for i, r in enumerate(reqs):
                assert r.state == State.DONE
                check_landed(dec, cache, r, i + 1)
                r.release()
            assert dec.allocator.free_pages == dec.layout.num_pages and not dec.requests
    p.put("stop")
    st = await p.result()
    assert st["done"] == len(lengths) and st["bad"] == 0 and st["free_pages"] == PAGES


async def test_cancel_before_during_and_after_the_transfer(provider: str, peers: list[Peer]) -> None:
    """No page is reused before the prefiller confirmed: canaries painted into cancelled
    pages right after cancel() returns stay intact, and a request given those pages next
    lands bit-exact (a stale write of the cancelled request, fired late by the shared
    layer clock, would clobber one or the other)."""
    lay = KvCacheLayout(**LAYOUT)
    p = start_prefiller(peers, provider, delay=0.12)
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            # before: B waits behind A at the prefiller; cancelled before it is computed
            a = await dec.submit(addr, 40, payload=(1).to_bytes(8, "little"))
            b = await dec.submit(addr, 30, payload=(2).to_bytes(8, "little"))
            await b.cancel()
            assert b.state == State.RELEASED
            paint(cache, b.pages)
            with pytest.raises(afabric.kvcache.RequestCancelled):
                await b.wait()
            await a.wait(timeout=30)
            check_landed(dec, cache, a, 1)
            a.release()

            # after: E completes, then is cancelled (its pages are simply given back)
            e = await dec.submit(addr, 16, payload=(5).to_bytes(8, "little"))
            await e.wait(timeout=30)
            await e.cancel()
            assert e.state == State.RELEASED

            # during: C is cancelled once its first layer has landed
            c = await dec.submit(addr, 200, payload=(3).to_bytes(8, "little"))
            await until(lambda: layer_landed(cache, c, 0, 3, lay), 30, "first layer of C")
            await c.cancel()
            last = lay.num_layers - 1
            assert not layer_landed(cache, c, last, 3, lay), "C completed before the cancel (test premise)"
            paint(cache, c.pages)

            # whatever of B and C could still fire would do so while D computes (the layer
            # clock moves on): D takes every free page, so B's and C's pages among them
            await asyncio.sleep(0.3)
            assert painted(cache, b.pages) and painted(cache, c.pages), "a write landed after confirmation"
            free = dec.allocator.free_pages
            d = await dec.submit(addr, free * lay.tokens_per_page, payload=(4).to_bytes(8, "little"))
            assert set(c.pages.tolist()) <= set(d.pages.tolist())
            await d.wait(timeout=60)
            check_landed(dec, cache, d, 4)
            d.release()
            assert dec.allocator.free_pages == lay.num_pages
    p.put("stop")
    st = await p.result()
    assert st["done"] == 3 and st["cancelled"] >= 1 and st["free_pages"] == PAGES


async def test_prefiller_killed_mid_request(provider: str, peers: list[Peer], shm_cleanup: None) -> None:
    lay = KvCacheLayout(**LAYOUT)
    p = start_prefiller(peers, provider, delay=0.3)
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider, op_timeout=3.0) as eng:
        dec, cache = decoder(eng, dead=DEAD)
        async with dec:
            r = await dec.submit(addr, 100, payload=(9).to_bytes(8, "little"))
            await until(lambda: layer_landed(cache, r, 0, 9, lay), 30, "first layer")
            p.kill()
            killed = time.monotonic()
            with pytest.raises(RequestFailed, match="silent"):
                await r.wait(timeout=DEAD + 10)
            assert time.monotonic() - killed < DEAD + 10
            await until(lambda: not dec.requests, 10, "pages freed")
            assert dec.allocator.free_pages == lay.num_pages


async def decode_proc(ctl: Ctl, provider: str, prefiller: bytes) -> None:
    """A decoder that asks for a long prefill, says so once its first layer landed, and
    waits to be killed."""
    lay = KvCacheLayout(**LAYOUT)
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            r = await dec.submit(prefiller, 300, payload=(11).to_bytes(8, "little"))
            await until(lambda: layer_landed(cache, r, 0, 11, lay), 30, "first layer")
            ctl.put("landing")
            await asyncio.sleep(3600)


async def test_decoder_killed_mid_request(provider: str, peers: list[Peer], shm_cleanup: None) -> None:
    p = start_prefiller(peers, provider, delay=0.3, op_timeout=3.0, dead=DEAD)
    addr_b = await p.get()
    d = Peer(decode_proc, provider, addr_b)
    peers.append(d)
    assert await d.get() == "landing"
    d.kill()
    t0 = time.monotonic()
    while True:  # the prefiller notices and frees the staging pages and the job
        st = await state(p)
        if st["active"] == 0 and st["free_pages"] == PAGES:
            break
        assert time.monotonic() - t0 < DEAD + 15, f"prefiller still holds the dead decoder's request: {st}"
        await asyncio.sleep(0.2)
    assert st.get("dead_decoders", 0) >= 1 or st.get("failed", 0) >= 1, st
    if provider == "shm" and libfabric_version() < (2, 0):
        return  # 1.17's shm endpoint stalls after a peer died (docs/limitations.md): nothing more to test
    # the prefiller serves others as before
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            r = await dec.submit(afabric.Address.from_bytes(addr_b), 50, payload=(12).to_bytes(8, "little"))
            await r.wait(timeout=60)
            check_landed(dec, cache, r, 12)


async def test_malformed_requests_are_refused_and_others_unaffected(provider: str, peers: list[Peer]) -> None:
    p = start_prefiller(peers, provider, delay=0.02)
    addr = afabric.Address.from_bytes(await p.get())
    lay = KvCacheLayout(**LAYOUT)
    async with afabric.Engine(provider) as eng, afabric.Engine(provider) as rogue:
        dec, cache = decoder(eng)
        async with dec:
            good = [
                await dec.submit(addr, n, payload=(20 + i).to_bytes(8, "little"))
                for i, n in enumerate([70, 5, 130])
            ]
            # the rogue: real descriptors of its own memory, then every kind of bad message
            rmem = np.zeros(lay.total_bytes, dtype=np.uint8)
            rbuf = rogue.register(rmem)
            rtail = rogue.register(np.zeros(lay.tail_region_bytes, dtype=np.uint8))
            assert rbuf.descriptor is not None and rtail.descriptor is not None
            me = bytes(rogue.address)

            def req(rid: int, segs: list[list[int]], **kw: Any) -> wire.Request:
                base: dict[str, Any] = {
                    "request_id": rid, "fingerprint": lay.fingerprint(), "num_pages": lay.num_pages,
                    "num_tokens": 40, "imm": 5, "write_tail": True, "tail_offset": 0,
                    "cache_desc": bytes(rbuf.descriptor or b""), "tail_desc": bytes(rtail.descriptor or b""),
                    "segments": np.array(segs, dtype=np.int64).reshape(-1, 3), "payload": b"",
                }  # fmt: skip
                return wire.Request(**{**base, **kw})

            bad_requests = {
                101: req(101, [[0, PAGES - 2, 5]]),  # runs past the cache's pages
                102: req(102, [[0, 0, 3], [2, 10, 2]]),  # overlapping prompt pages
                103: req(103, [[0, 0, 5]], fingerprint=b"\1" * 16),  # other geometry
                104: req(104, [[0, 0, 5]], cache_desc=b"\0" * 40),  # not a descriptor
                105: req(105, [[0, 0, 5]], num_tokens=10**6),  # longer than the staging cache
                106: req(106, [[0, 0, 5]], tail_offset=lay.tail_region_bytes),  # tail outside
                107: req(107, [[0, 0, 6]]),  # past the prompt's 5 pages
            }
            sends = [
                m for r in bad_requests.values() for m in wire.encode_request(me, r, rogue.max_message_size)
            ]
            frags = wire.encode_request(me, req(108, [[0, 0, 5]], payload=b"p" * 5000), 1024)
            sends += [frags[0], frags[0]]  # a fragment twice
            good_msg = wire.encode_heartbeat(me, wire.DECODER, 1)
            sends += [
                b"", b"garbage", good_msg[:-1], good_msg + b"x",
                good_msg[:20] + bytes([good_msg[20] ^ 1]) + good_msg[21:],  # corrupted
                np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8).tobytes(),
            ]  # fmt: skip
            # a cancel that overtakes its (valid) request: the request is dropped when it comes
            sends += [wire.encode_cancel(me, 109), *wire.encode_request(me, req(109, [[0, 0, 5]]), 65536)]
            for m in sends:
                await rogue.send(addr, m, tag=TAG_KVCACHE)
            # the parseable bad requests are answered with a refusal each
            refused: dict[int, str] = {}
            while set(refused) < set(bad_requests) | {108, 109}:
                m = wire.parse(await asyncio.wait_for(rogue.recv_bytes(tag=TAG_KVCACHE), 30))
                if isinstance(m, wire.Confirm):
                    want = wire.CANCELLED if m.request_id == 109 else wire.REJECTED
                    assert m.status == want and m.arrivals == 0, m
                    refused[m.request_id] = m.reason
            assert "past the cache" in refused[101] and "overlap" in refused[102]
            assert "geometry" in refused[103] and "descriptor" in refused[104] and "twice" in refused[108]
            more = await dec.submit(addr, 33, payload=(30).to_bytes(8, "little"))
            for i, r in enumerate([*good, more]):
                await r.wait(timeout=60)
                check_landed(dec, cache, r, 30 if r is more else 20 + i)
                r.release()
            assert not rmem.any(), "a refused request wrote into the rogue's memory"
    p.put("stop")
    st = await p.result()
    assert st["done"] == 4 and st["rejected"] >= 8 and st["bad"] >= 8 + 6


async def test_a_refused_request_fails_on_the_decoder(provider: str, peers: list[Peer]) -> None:
    p = start_prefiller(peers, provider, staging=4)  # 32 tokens of staging
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider) as eng:
        dec, _cache = decoder(eng)
        async with dec:
            r = await dec.submit(addr, 100)
            with pytest.raises(RequestRejected, match="tokens"):
                await r.wait(timeout=30)
            await until(lambda: not dec.requests, 10, "pages freed")
            with pytest.raises(ProtocolError):
                await dec.submit(addr, 10, payload=b"x" * (wire.MAX_BLOB + 1))
            assert dec.allocator.free_pages == dec.layout.num_pages
    p.put("stop")
    await p.result()


async def test_replicated_cache_filled_by_balanced_random_ranks(provider: str, peers: list[Peer]) -> None:
    lay = KvCacheLayout(**MLA)
    ranks = [start_prefiller(peers, provider, MLA) for _ in range(3)]
    addrs = [afabric.Address.from_bytes(await p.get()) for p in ranks]
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng, MLA)
        async with dec:
            lengths = [300, 47, 200, 5]
            reqs = [
                await dec.submit(addrs, n, payload=(40 + i).to_bytes(8, "little"))
                for i, n in enumerate(lengths)
            ]
            for i, r in enumerate(reqs):
                await r.wait(timeout=60)
                check_landed(dec, cache, r, 40 + i)
                r.release()
    stats = []
    for p in ranks:
        p.put("stop")
        stats.append(await p.result())
    written = [s.get("pages_written", 0) for s in stats]
    total = sum(lay.pages_for(n) for n in lengths)
    assert sum(written) == total and min(written) > 0, written
    # per request each rank gets a share within one piece of the others
    assert max(written) - min(written) <= sum(-(-lay.pages_for(n) // 3) for n in lengths), written
