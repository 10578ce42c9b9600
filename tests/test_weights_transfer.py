"""End to end, multi-process: trainers (DTensor shards over gloo) write weights straight
into inference ranks' registered memory over real providers; inference checks every
tensor against whole weights it computes itself."""

from __future__ import annotations

import time
from typing import Any

import pytest

from .procs import Peer
from .weights_procs import free_port, member

MODEL = {"layers": 2, "hidden": 384, "experts": 4, "moe_intermediate": 256, "vocab": 1000}


async def run_world(provider: str, peers: list[Peer], n_inf: int, cfg: dict[str, Any],
                    timeout: float = 120) -> list[dict[str, Any]]:  # fmt: skip
    world = cfg["trainers"] + n_inf
    port = free_port()
    ps = [Peer(member, provider, r, world, port, cfg) for r in range(world)]
    peers.extend(ps)
    return [await p.result(timeout) for p in ps]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
async def test_update_twice(provider: str, fp8: bool, peers: list[Peer]) -> None:
    cfg = {"trainers": 3, "model": MODEL, "tp": 2, "fp8": fp8, "steps": 2,
           "options": {"direct_min_bytes": 4096}}  # fmt: skip
    res = await run_world(provider, peers, 2, cfg)
    inf = [r for r in res if r["rank"] >= 3]
    assert all(len(r["steps"]) == 2 for r in res)
    assert [s["version"] for s in inf[0]["steps"]] == [1, 2]
    if fp8:
        assert res[0]["fp8_tasks"] > 0 and res[0]["unshard"] > 0  # tiles cross uneven shards
    else:
        assert res[0]["direct_tasks"] > 0
    sent = sum(r["steps"][0]["bytes_sent"] for r in res)
    assert sent == sum(r["steps"][0]["bytes_received"] for r in inf)
