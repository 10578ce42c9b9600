"""KV-cache pull mode between real processes over real providers (tcp, shm): the decoder
reads the prefiller's held pages (byte-exact, beside push requests), the prefiller keeps
them until released, and every way a pull can end early (cancel, a dead prefiller, a dead
decoder, a read that fails, a forged or malformed READY) fails the request with a typed
error in bounded time and frees the pages on both sides."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import afabric
from afabric.kvcache import KvCacheLayout, RequestCancelled, RequestFailed, State, wire
from afabric.kvcache.views import gather_layer
from afabric.messages import TAG_KVCACHE

from .procs import Ctl, Peer
from .test_kvcache import (
    DEAD,
    LAYOUT,
    MLA,
    PAGES,
    check_landed,
    decoder,
    kv_for,
    paint,
    painted,
    start_prefiller,
    state,
    until,
)


async def ksend(eng: afabric.Engine, addr: Any, msg: bytes) -> None:
    """Send a hand-made kvcache message as Decoder and Prefiller do."""
    await eng.send(addr, msg, tag=TAG_KVCACHE)


async def krecv(eng: afabric.Engine) -> bytes:
    """The next kvcache message's bytes."""
    return await eng.recv_bytes(tag=TAG_KVCACHE)


def seed_bytes(seed: int) -> bytes:
    return seed.to_bytes(8, "little")


@pytest.mark.both_loops
async def test_pull_and_push_requests_land_bit_exact(provider: str, peers: list[Peer]) -> None:
    lay = KvCacheLayout(**LAYOUT)
    p = start_prefiller(peers, provider)
    addr = afabric.Address.from_bytes(await p.get())
    lengths = [1, 8, 9, 64, 100, 250, 333]
    modes = ["pull", "push", "pull", "pull", "push", "pull", "pull"]
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            reqs = await asyncio.gather(*(
                dec.submit(addr, n, payload=seed_bytes(i + 1), mode=m)
                for i, (n, m) in enumerate(zip(lengths, modes, strict=True))
            ))  # fmt: skip
            await asyncio.gather(*(r.wait(timeout=60) for r in reqs))
            for i, r in enumerate(reqs):
                assert r.state == State.DONE and r.mode == modes[i]
                check_landed(dec, cache, r, i + 1)
                r.release()
            assert dec.allocator.free_pages == lay.num_pages and not dec.requests
            assert dec.bad_messages == 0
    p.put("stop")
    st = await p.result()
    pulled = sum(lay.pages_for(n) for n, m in zip(lengths, modes, strict=True) if m == "pull")
    assert st["done"] == len(lengths) and st["ready"] == modes.count("pull") and st["bad"] == 0
    assert st["pages_read"] == pulled and st["free_pages"] == PAGES


async def test_pull_from_replicated_ranks(provider: str, peers: list[Peer]) -> None:
    lay = KvCacheLayout(**MLA)
    ranks = [start_prefiller(peers, provider, MLA) for _ in range(3)]
    addrs = [afabric.Address.from_bytes(await p.get()) for p in ranks]
    lengths = [300, 47, 200, 5]
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng, MLA)
        async with dec:
            for i, n in enumerate(lengths):
                r = await dec.submit(addrs, n, payload=seed_bytes(40 + i), mode="pull")
                await r.wait(timeout=60)
                check_landed(dec, cache, r, 40 + i)
                r.release()
    read = []
    for p in ranks:
        p.put("stop")
        st = await p.result()
        read.append(st.get("pages_read", 0))
        assert st["free_pages"] == PAGES and st.get("pages_written", 0) == 0
    assert sum(read) == sum(lay.pages_for(n) for n in lengths) and min(read) > 0, read


async def test_pull_cancel_before_and_after(provider: str, peers: list[Peer]) -> None:
    """A pulled request cancelled while its prefiller computes: its pages are free when
    cancel() returns, nothing lands in them later (canary), the prefiller frees its staging
    pages; one cancelled after completion just gives its pages back."""
    p = start_prefiller(peers, provider, delay=0.1)
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider) as eng:
        dec, cache = decoder(eng)
        async with dec:
            e = await dec.submit(addr, 16, payload=seed_bytes(5), mode="pull")
            await e.wait(timeout=30)
            check_landed(dec, cache, e, 5)
            await e.cancel()
            assert e.state == State.RELEASED
            a = await dec.submit(addr, 40, payload=seed_bytes(1), mode="pull")
            b = await dec.submit(addr, 30, payload=seed_bytes(2), mode="pull")
            with pytest.raises(afabric.errors.OperationTimeout):  # A computing, B queued
                await a.wait(timeout=0.3)
            assert a.state == State.PENDING  # a timeout does not end the request
            await a.cancel()
            await b.cancel()
            assert a.state == b.state == State.RELEASED and not dec.requests
            paint(cache, a.pages)
            paint(cache, b.pages)
            with pytest.raises(RequestCancelled):
                await a.wait()
            await asyncio.sleep(1.0)  # A's computation ends meanwhile: its READY is answered, not read
            assert painted(cache, a.pages) and painted(cache, b.pages), "a cancelled pull landed"
            t0 = time.monotonic()
            while (st := await state(p))["active"] or st["free_pages"] != PAGES:
                assert time.monotonic() - t0 < 20, f"the prefiller still holds cancelled pages: {st}"
                await asyncio.sleep(0.1)
            assert dec.bad_messages == 0
    p.put("stop")
    st = await p.result()
    assert st["done"] == 1 and st["cancelled"] >= 1 and st["free_pages"] == PAGES


async def rogue_decoder_proc(ctl: Ctl, provider: str, prefiller: bytes, tokens: int) -> None:
    """A decoder speaking the wire protocol by hand: asks for a pull, reports the READY,
    reads the held pages on "read" (answering them), releases on "release", and otherwise
    waits (to be killed)."""
    lay = KvCacheLayout(**LAYOUT)
    addr = afabric.Address.from_bytes(prefiller)
    async with afabric.Engine(provider) as eng:
        me = bytes(eng.address)
        mine = eng.register(np.zeros(lay.total_bytes, dtype=np.uint8))
        tail = eng.register(np.zeros(lay.tail_region_bytes, dtype=np.uint8))
        assert mine.descriptor is not None and tail.descriptor is not None
        rids = iter(range(1, 1000))

        async def ask(seed: int) -> int:
            rid = next(rids)
            n = lay.pages_for(tokens)
            desc = bytes(mine.descriptor or b"")
            req = wire.Request(
                rid, lay.fingerprint(), lay.num_pages, tokens, 3, False, 0, desc, b"",
                np.array([[0, 0, n]], dtype=np.int64), seed_bytes(seed), pull=True,
            )  # fmt: skip
            for frag in wire.encode_request(me, req, eng.max_message_size):
                await ksend(eng, addr, frag)
            return rid

        async def ready() -> wire.Ready:
            while True:
                m = wire.parse(await krecv(eng))
                if isinstance(m, wire.Ready):
                    return m

        async def beat() -> None:
            seq = 0
            while True:
                seq += 1
                await ksend(eng, addr, wire.encode_heartbeat(me, wire.DECODER, seq))
                await asyncio.sleep(0.2)

        beating = asyncio.ensure_future(beat())
        held: list[wire.Ready] = []
        while (cmd := await ctl.get(timeout=300)) != "stop":
            if isinstance(cmd, tuple) and cmd[0] == "ask":
                ctl.put(await ask(cmd[1]))
            elif cmd == "ready":
                held.append(await ready())
                ctl.put((held[-1].request_id, held[-1].first_page, held[-1].staging_pages))
            elif isinstance(cmd, tuple) and cmd[0] == "read":
                m = next(h for h in held if h.request_id == cmd[1])
                desc = afabric.MrDesc.from_bytes(m.cache_desc)
                local = np.zeros(desc.length, dtype=np.uint8)
                await eng.read(eng.register(local), desc, desc.length)
                ctl.put(local)
            elif isinstance(cmd, tuple) and cmd[0] == "release":
                await ksend(eng, addr, wire.encode_release(me, cmd[1]))
                ctl.put("ok")
        beating.cancel()


async def test_prefiller_holds_pages_until_released(provider: str, peers: list[Peer]) -> None:
    """Staging for exactly one request: a second pull waits while the first's pages are
    held (the first's data stays intact however long the decoder takes), runs once they
    are released, and both read back byte-exact."""
    lay = KvCacheLayout(**LAYOUT)
    tokens = 40
    n = lay.pages_for(tokens)
    p = start_prefiller(peers, provider, staging=n)
    addr = await p.get()
    d = Peer(rogue_decoder_proc, provider, addr, tokens)
    peers.append(d)
    stage = lay.with_pages(n)

    def check(raw: np.ndarray, first: int, seed: int) -> None:
        cache = raw.view(np.float16).reshape(stage.shape())
        pages = np.arange(first, first + n)
        for layer in range(lay.num_layers):
            got = gather_layer(cache, layer, pages, tokens)
            assert np.array_equal(got.view(np.uint16), kv_for(seed, layer, tokens, lay).view(np.uint16))

    d.put(("ask", 1))
    r1 = await d.get()
    d.put("ready")
    rid, first, pages = await d.get()
    assert rid == r1 and pages == n
    d.put(("ask", 2))
    r2 = await d.get()
    await asyncio.sleep(1.0)  # the model would take 0 s: request 2 waits only for the pages
    st = await state(p)
    assert st["active"] == 2 and st["free_pages"] == 0 and st["ready"] == 1, st
    d.put(("read", r1))
    check(await d.get(), first, 1)
    d.put(("release", r1))
    assert await d.get() == "ok"
    d.put("ready")
    rid, first, _ = await d.get()
    assert rid == r2
    d.put(("read", r2))
    check(await d.get(), first, 2)
    d.put(("release", r2))
    assert await d.get() == "ok"
    t0 = time.monotonic()
    while (st := await state(p))["active"]:
        assert time.monotonic() - t0 < 20, st
        await asyncio.sleep(0.1)
    assert st["done"] == 2 and st["pages_read"] == 2 * n and st["free_pages"] == n
    d.put("stop")
    await d.result()


async def test_decoder_killed_while_pages_held(provider: str, peers: list[Peer], shm_cleanup: None) -> None:
    lay = KvCacheLayout(**LAYOUT)
    p = start_prefiller(peers, provider, op_timeout=3.0, dead=DEAD)
    addr = await p.get()
    d = Peer(rogue_decoder_proc, provider, addr, 100)
    peers.append(d)
    d.put(("ask", 7))
    await d.get()
    d.put("ready")
    await d.get()
    st = await state(p)
    assert st["active"] == 1 and st["free_pages"] == PAGES - lay.pages_for(100), st
    d.kill()
    t0 = time.monotonic()
    while (st := await state(p))["active"] or st["free_pages"] != PAGES:
        assert time.monotonic() - t0 < DEAD + 15, f"the dead decoder's pages are still held: {st}"
        await asyncio.sleep(0.2)
    assert st.get("dead_decoders", 0) >= 1 and st.get("failed", 0) >= 1, st


async def test_prefiller_killed_mid_pull(provider: str, peers: list[Peer], shm_cleanup: None) -> None:
    p = start_prefiller(peers, provider, delay=0.3)
    addr = afabric.Address.from_bytes(await p.get())
    async with afabric.Engine(provider, op_timeout=3.0) as eng:
        dec, _cache = decoder(eng, dead=DEAD)
        async with dec:
            r = await dec.submit(addr, 100, payload=seed_bytes(9), mode="pull")
            await asyncio.sleep(0.5)
            p.kill()
            killed = time.monotonic()
            with pytest.raises(RequestFailed, match="silent"):
                await r.wait(timeout=DEAD + 10)
            assert time.monotonic() - killed < DEAD + 10
            await until(lambda: not dec.requests, 10, "pages freed")
            assert dec.allocator.free_pages == dec.layout.num_pages


async def test_bad_ready_messages(provider: str, peers: list[Peer]) -> None:
    """A rogue 'prefiller' answers pull requests by hand: a READY from a peer not asked is
    dropped (the request is not touched); malformed ones (write-only region, pages past the
    staging region, a tail not asked for) fail the request before any read is posted; one
    naming a region of an engine that is gone fails it when the read fails, in bounded
    time. Every time the request's pages are freed and a RELEASE goes back."""
    lay = KvCacheLayout(**LAYOUT)
    async with (
        afabric.Engine(provider, op_timeout=3.0) as eng,
        afabric.Engine(provider) as rogue,
        afabric.Engine(provider) as other,
    ):  # fmt: skip
        stage = np.zeros(lay.total_bytes, dtype=np.uint8)
        readable = rogue.register(stage, remote="r")
        writable = rogue.register(np.zeros(lay.total_bytes, dtype=np.uint8), remote="w")
        async with afabric.Engine(provider) as gone_eng:
            gone = gone_eng.register(np.zeros(lay.total_bytes, dtype=np.uint8), remote="r")
            gone_desc = bytes(gone.descriptor or b"")
        me, oth = bytes(rogue.address), bytes(other.address)
        rdesc, wdesc = bytes(readable.descriptor or b""), bytes(writable.descriptor or b"")
        dec, cache = decoder(eng)
        async with dec:

            async def request() -> tuple[Any, int]:
                r = await dec.submit(rogue.address, 20, payload=seed_bytes(3), mode="pull")
                while True:
                    m = wire.parse(await asyncio.wait_for(krecv(rogue), 30))
                    if isinstance(m, wire.Fragment):
                        req = wire.parse_request(m.request_id, m.chunk)
                        assert req.pull and m.count == 1
                        return r, m.request_id

            async def released(rid: int) -> None:
                while True:
                    m = wire.parse(await asyncio.wait_for(krecv(rogue), 30))
                    if isinstance(m, (wire.Release, wire.Cancel)) and m.request_id == rid:
                        return

            cases = [  # the decoder asked for the tail too (the layout has one)
                (wire.encode_ready(me, 0, PAGES, 0, wdesc, rdesc), "does not let peers read"),
                (wire.encode_ready(me, 0, PAGES, PAGES - 1, rdesc, rdesc), "past its"),
                (wire.encode_ready(me, 0, PAGES * 2, 0, rdesc, rdesc), "do not fit"),
                (wire.encode_ready(me, 0, PAGES, 0, rdesc), "no tail, one asked"),
                (wire.encode_ready(me, 0, PAGES, 0, gone_desc, rdesc), "reading from a prefiller failed"),
            ]
            for template, why in cases:
                r, rid = await request()
                paint(cache, r.pages)
                # forged by another peer (the right request id): dropped
                await ksend(other, dec.eng.address, _with(template, oth, rid))
                await asyncio.sleep(0.2)
                assert r.state == State.PENDING
                t0 = time.monotonic()
                await ksend(rogue, dec.eng.address, _with(template, me, rid))
                with pytest.raises(RequestFailed, match=why):
                    await r.wait(timeout=20)
                await released(rid)
                await until(lambda: not dec.requests, 20, "pages freed")
                assert time.monotonic() - t0 < 15
                assert dec.allocator.free_pages == lay.num_pages
                if "read" not in why:
                    assert painted(cache, r.pages), "a refused READY was read"
            assert dec.bad_messages >= 2 * len(cases) - 1

            # cancelled while a read is in flight (of a region that is gone: it fails within
            # op_timeout): cancel() returns, and the pages are free, only once it has ended
            r, rid = await request()
            await ksend(rogue, dec.eng.address, _with(cases[-1][0], me, rid))
            await until(lambda: any(k.reading is not None for k in r.ranks), 20, "the read posted")
            t0 = time.monotonic()
            await r.cancel()
            assert all(k.reading is not None and k.reading.done() for k in r.ranks), "freed mid-read"
            assert r.state == State.RELEASED and not dec.requests and time.monotonic() - t0 < 15
            assert dec.allocator.free_pages == lay.num_pages


def _with(template: bytes, sender: bytes, rid: int) -> bytes:
    """A READY like ``template`` from ``sender`` for request ``rid``."""
    m = wire.parse(template)
    assert isinstance(m, wire.Ready)
    return wire.encode_ready(
        sender, rid, m.staging_pages, m.first_page, m.cache_desc, m.tail_desc, m.tail_offset
    )


_PUSH_ONLY_CHECK = """
import asyncio, numpy as np, afabric
from afabric.kvcache import Decoder, KvCacheLayout, Prefiller, RequestRejected
from afabric.kvcache.views import gather_layer, store_layer
async def main():
    lay = KvCacheLayout(num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", tokens_per_page=8,
                        num_pages=16, tail_bytes=64, tail_slots=4)
    async with afabric.Engine("tcp") as a, afabric.Engine("tcp") as b:
        cache, staging = np.zeros(lay.shape(), np.float16), np.zeros(lay.shape(), np.float16)
        async with Decoder(a, lay, cache=cache) as dec, Prefiller(b, lay, cache=staging) as pf:
            assert not pf.pull, "pull mode on a provider without reads"
            async def serve():
                async for job in pf.jobs():
                    async with job:
                        for l in range(lay.num_layers):
                            kv = np.full((2, 1, job.num_tokens, 16), l + 1, np.float16)
                            store_layer(staging, l, job.first_page, kv)
                            job.layer_done()
                        job.tail[:] = 5
                        job.tail_done()
            server = asyncio.ensure_future(serve())
            r = await dec.submit(b.address, 20)
            await r.wait(timeout=30)
            for l in range(lay.num_layers):
                assert (gather_layer(cache, l, r.pages, 20) == l + 1).all()
            r.release()
            p = await dec.submit(b.address, 20, mode="pull")
            try:
                await p.wait(timeout=30)
                raise SystemExit("a pull request served without reads")
            except RequestRejected as e:
                print("pull:", e)
            server.cancel()
asyncio.run(main())
print("ok")
"""


def test_a_provider_without_reads_still_serves_push(tmp_path: Any) -> None:
    """On a provider library from before reads (ABI minor 3) a Prefiller still starts (its
    staging cache registered without remote read), serves push requests, and refuses
    pull requests with a reason (RequestRejected on the decoder)."""
    from .test_read import run_on_a_minor3_provider

    out = run_on_a_minor3_provider(tmp_path, _PUSH_ONLY_CHECK)
    assert "does not serve pull requests" in out, out
