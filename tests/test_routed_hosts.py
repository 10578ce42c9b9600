"""The default engine routes across hosts (tests/hosts.py: host A and host B, one veth
pair): a process of A reaches another of A over cma and one of B over tcp, in one
operation where the operation spans peers; the systems built on the engine (KV-cache
transfer, weight transfer, the MoE host proxy) run unchanged over it. Every engine runs in
a peer process of A or B (the test process is on neither host)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import afabric
from afabric.kvcache import State

from . import hosts
from .hosts import TwoHosts
from .procs import Ctl, Peer
from .test_kvcache import LAYOUT, PAGES, SLOW, check_landed, decoder, prefill_proc
from .test_moe_proxy import _rank, run_protocol
from .test_routed import REGION, target
from .weights_procs import free_port, member

IMM = 11


@pytest.fixture
def bed() -> Iterator[TwoHosts]:
    hosts.require()
    with TwoHosts() as tb:
        yield tb


def _writes(eng: afabric.Engine, key: str) -> dict[str, int]:
    """One counter of the engine's NICs, per transport."""
    return {n["transport"]: int(n[key]) for n in eng.stats()["nics"]}  # type: ignore[literal-required]


def _src() -> np.ndarray:
    """Two regions' worth of bytes: the first for the peer on A, the second for B's."""
    return np.random.default_rng(3).integers(0, 256, 2 * REGION, dtype=np.uint8)


# ---- child processes (module-level: pickled under spawn) ----


async def routed_writer(
    ctl: Ctl, bind: str, targets: list[tuple[bytes, bytes]]
) -> dict[str, Any]:  # fmt: skip
    """A default engine: one scatter with an immediate to both targets (A's, then B's), a
    read back from each, a message to each and its reply. Returns what it saw."""
    out: dict[str, Any] = {}
    async with afabric.Engine(bind=bind, op_timeout=30) as eng:
        descs = [afabric.MrDesc.from_bytes(d) for d, _ in targets]
        addrs = [afabric.Address.from_bytes(a) for _, a in targets]
        out["routes"] = [eng.route(a) for a in addrs]
        src = _src()
        mr = eng.register(src)
        parts = [afabric.ScatterTarget(d, REGION, i * REGION, 0) for i, d in enumerate(descs)]
        await asyncio.wait_for(eng.scatter(mr, parts, imm=IMM), 60)
        dst = np.zeros(2 * REGION, dtype=np.uint8)
        dmr = eng.register(dst)
        reads = (eng.read(dmr, d, REGION, dst_offset=i * REGION) for i, d in enumerate(descs))
        await asyncio.wait_for(asyncio.gather(*reads), 60)
        out["read_back"] = bool(np.array_equal(dst, src))
        for i, a in enumerate(addrs):
            await eng.send(a, bytes([i]) + b"hello", tag=5)
        replies = [await asyncio.wait_for(eng.recv(tag=6), 60) for _ in addrs]
        out["replies"] = sorted((addrs.index(r.sender), bytes(r.data)) for r in replies)
        out["writes"], out["reads"], out["sends"] = (_writes(eng, k) for k in ("writes", "reads", "sends"))
    return out


async def kv_decoder(ctl: Ctl, bind: str, prefillers: list[bytes]) -> dict[str, Any]:
    """A default engine's decoder: requests to each prefiller (A's and B's) at once, every
    one checked bit-exact. Returns its routes to them and the immediates per transport."""
    addrs = [afabric.Address.from_bytes(a) for a in prefillers]
    lengths = [[70, 9], [130, 1]]  # per prefiller
    async with afabric.Engine(bind=bind) as eng:
        dec, cache = decoder(eng)
        async with dec:
            reqs = await asyncio.gather(*(
                dec.submit(a, n, payload=(10 * i + j + 1).to_bytes(8, "little"))
                for i, a in enumerate(addrs) for j, n in enumerate(lengths[i])
            ))  # fmt: skip
            await asyncio.gather(*(r.wait(timeout=60) for r in reqs))
            for k, r in enumerate(reqs):
                assert r.state == State.DONE
                check_landed(dec, cache, r, 10 * (k // 2) + k % 2 + 1)
                r.release()
            assert dec.allocator.free_pages == dec.layout.num_pages
            return {"routes": [eng.route(a) for a in addrs], "imms": _writes(eng, "imms"), "done": len(reqs)}


# ---- tests ----


async def test_one_scatter_reaches_this_host_over_cma_and_the_other_over_tcp(
    bed: TwoHosts, peers: list[Peer]
) -> None:
    """One default engine of A scatters with an immediate to a peer of A and one of B: each
    target counts the immediate and holds its bytes; reads back and a message each way too,
    and the writer's counters show writes, reads and sends on both transports."""
    a_ip, b_ip = bed.host_addr("a"), bed.host_addr("b")
    ta, tb = bed.peer("a", target, "auto", False, a_ip), bed.peer("b", target, "auto", False, b_ip)
    peers += [ta, tb]
    infos = [await p.get() for p in (ta, tb)]
    assert [t for _, _, t in infos] == [("cma", "tcp")] * 2
    for p in (ta, tb):
        p.put(("expect", IMM, 1))
    w = bed.peer("a", routed_writer, a_ip, [(d, a) for d, a, _ in infos])
    peers.append(w)
    for p in (ta, tb):
        assert await p.get() == "counted"
    src = _src()
    for i, p in enumerate((ta, tb)):
        p.put("bytes")
        got = np.frombuffer(await p.get(), dtype=np.uint8)
        assert np.array_equal(got, src[i * REGION : (i + 1) * REGION]), f"target {i}"
        p.put("echo")
    out = await w.result(timeout=120)
    assert out["routes"] == ["cma", "tcp"]
    assert out["read_back"]
    assert out["replies"] == [(0, b"olleh\x00"), (1, b"olleh\x01")]
    for key in ("writes", "reads", "sends"):
        assert out[key]["cma"] > 0 and out[key]["tcp"] > 0, (key, out[key])
    # each target answered the writer over the transport it was reached by
    assert [await p.get() for p in (ta, tb)] == ["cma", "tcp"]
    for p in (ta, tb):
        p.put("stop")
        assert await p.result() == "stopped"


async def test_kv_cache_from_a_prefiller_on_each_host(bed: TwoHosts, peers: list[Peer]) -> None:
    """A decoder of A fed by a prefiller of A (cma) and one of B (tcp), concurrently: every
    request lands bit-exact, and immediates arrived over both transports."""
    a_ip, b_ip = bed.host_addr("a"), bed.host_addr("b")
    pfs = [bed.peer(side, prefill_proc, "auto", LAYOUT, PAGES, 0.0, 20.0, SLOW, ip)
           for side, ip in (("a", a_ip), ("b", b_ip))]  # fmt: skip
    peers += pfs
    addrs = [await p.get() for p in pfs]
    d = bed.peer("a", kv_decoder, a_ip, addrs)
    peers.append(d)
    out = await d.result(timeout=180)
    assert out["routes"] == ["cma", "tcp"] and out["done"] == 4
    assert out["imms"]["cma"] > 0 and out["imms"]["tcp"] > 0, out["imms"]
    for p in pfs:
        p.put("stop")
        st = await p.result(timeout=60)
        assert st["done"] == 2 and st["bad"] == 0 and st["free_pages"] == PAGES, st


@pytest.mark.timeout(240)
async def test_weights_to_an_inference_rank_on_each_host(bed: TwoHosts, peers: list[Peer]) -> None:
    """A trainer of A writes weights (TP 2) into an inference rank of A (cma) and one of B
    (tcp) for two steps; each inference rank checks every tensor against whole weights."""
    pytest.importorskip("torch", reason="torch is not installed (bash tests/run.sh --all installs it)")
    a, b = (bed.host_addr("a"), "r0a"), (bed.host_addr("b"), "r0b")
    model = {"layers": 2, "hidden": 384, "experts": 4, "moe_intermediate": 256, "vocab": 1000}
    cfg = {"trainers": 1, "model": model, "tp": 2, "fp8": False, "steps": 2,
           "options": {"direct_min_bytes": 4096}, "hosts": [a, a, b]}  # fmt: skip
    port = free_port()
    ranks = [bed.peer(side, member, "auto", r, 3, port, cfg) for r, side in enumerate("aab")]
    peers += ranks
    res = [await p.result(timeout=200) for p in ranks]
    assert all(len(r["steps"]) == 2 for r in res)
    assert [[s["version"] for s in r["steps"]] for r in res[1:]] == [[1, 2], [1, 2]]
    trainer = res[0]
    assert trainer["writes"]["cma"] > 0 and trainer["writes"]["tcp"] > 0, trainer["writes"]
    for step in range(2):
        sent = trainer["steps"][step]["bytes_sent"]
        assert sent > 0 and sent == sum(r["steps"][step]["bytes_received"] for r in res[1:])
        assert all(r["steps"][step]["bytes_received"] > 0 for r in res[1:])


@pytest.mark.timeout(120)
async def test_moe_proxy_on_one_host_over_cma(bed: TwoHosts, peers: list[Peer]) -> None:
    """The MoE host proxy's calls between two ranks of A, each on a default engine: every
    phase lands (checked in the ranks), and every write went over cma."""
    ranks = [bed.peer("a", _rank, r, "auto") for r in range(2)]
    peers += ranks
    for writes in await run_protocol(ranks):
        assert writes["cma"] > 0 and writes["tcp"] == 0, writes
