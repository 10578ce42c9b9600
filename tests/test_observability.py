"""Per-operation stage timing and per-NIC counters report what actually happened."""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest

import afabric
from afabric import errors


async def test_stage_timestamps_are_ordered_and_complete(provider: str) -> None:
    async with afabric.Engine(provider, timing=True) as a, afabric.Engine(provider) as b:
        dst = b.register(np.zeros(1 << 20, dtype=np.uint8))
        src = a.register(np.ones(1 << 20, dtype=np.uint8))
        t0 = time.monotonic_ns()
        await a.write(src, dst.descriptor, 4096)
        await a.write_paged(
            src, dst.descriptor, page_len=1024, src_pages=afabric.Pages(range(16), 1024),
            dst_pages=afabric.Pages(range(16), 1024),
        )  # fmt: skip
        await a.scatter(src, [afabric.ScatterTarget(dst.descriptor, 64, 0, i * 64) for i in range(8)])
        await a.send(b.address, b"ping")
        assert await b.recv_bytes() == b"ping"
        t1 = time.monotonic_ns()
        got = a.timings()
        assert [t.kind for t in got] == ["write", "paged", "scatter", "send"]
        assert [t.work_requests for t in got] == [1, 16, 8, 1]
        for t in got:
            assert t.status == 0
            assert t0 <= t.t_enqueue <= t.t_pickup <= t.t_first_post <= t.t_last_post <= t.t_complete <= t1
            stages = t.stages_ns()
            assert stages["total"] == sum(
                stages[k] for k in ("queued", "to_first_post", "posting", "in_flight")
            )
        assert a.timings() == []  # drained
        with pytest.raises(errors.InvalidArgument):
            b.timings()  # not created with timing on


async def test_counters_follow_the_traffic(provider: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="afabric")
    async with afabric.Engine(provider, name="counted") as a, afabric.Engine(provider) as b:
        assert any("counted" in r.name for r in caplog.records), "the engine logs under its name"
        dst = b.register(np.zeros(1 << 20, dtype=np.uint8))
        src = a.register(np.ones(1 << 20, dtype=np.uint8))
        before = a.stats()["nics"][0]
        for _ in range(10):
            await a.write(src, dst.descriptor, 1000, imm=7)
        await a.send(b.address, b"x" * 10)
        await b.recv()
        await b.expect_imm(7, 10, timeout=10)
        after, target = a.stats()["nics"][0], b.stats()["nics"][0]
        assert after["writes"] - before["writes"] == 10
        assert after["write_bytes"] - before["write_bytes"] == 10_000
        assert after["sends"] - before["sends"] == 1
        assert target["imms"] >= 10 and target["recvs"] >= 1
        assert after["errors"] == 0
        assert after["outstanding"] == 0 and after["completions"] - before["completions"] == 11
        stats = a.stats()
        assert stats["ops_in_flight"] == 0 and stats["provider"] == provider
