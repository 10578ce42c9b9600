"""`afabric bench overhead` runs end to end: target processes hosting the peer engines, the
stage breakdown of every scatter, the JSON report. Speed is reported, never asserted; what
is checked is that the measurement is sound (the stages add up, the clocks agree)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

STAGES = ("submit", "queued", "to_first_post", "posting", "in_flight", "resume", "total", "app")


@pytest.mark.timeout(150)
def test_bench_overhead_quick(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    proc = subprocess.run(
        [sys.executable, "-m", "afabric.cli", "bench", "overhead", "--quick", "--peers", "8",
         "--provider", "shm", "--loop", "asyncio", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "overhead" and doc["provider"] == "shm"
    assert doc["size"] == 64 and doc["stages"] == list(STAGES)
    [res] = doc["results"]
    assert res["peers"] == 8 and res["iterations"] == 300
    assert res["work_requests"] == 8  # one write per peer
    assert sum(res["target_processes"]) == 8
    assert res["check"] == "all 8 targets got the final scatter"
    # The shim's stamps lie inside the application's own clock readings around each await.
    assert res["clock_disagreements"] == 0
    stages = res["stages"]
    assert set(stages) == set(STAGES)
    for name in STAGES:
        s = stages[name]
        assert len(res["samples_ns"][name]) == 300, name
        if name == "posting":
            # Up to 32 peers one provider call posts every write, so the first and last post
            # are stamped back to back: a few tens of ns, which a coarse clock may read as 0.
            assert s["p50_us"] >= 0, name
        else:
            assert s["p50_us"] > 0, name
        assert s["min_us"] <= s["p50_us"] <= s["p99_us"] <= s["p999_us"] <= s["max_us"], name
    # Every scatter's total covers each of its shim stages, and the application's time
    # covers the total: order statistics keep that, so the p50s must too (with slack for
    # the rounding to µs).
    total = stages["total"]["p50_us"]
    for name in ("queued", "to_first_post", "posting", "in_flight"):
        assert total + 0.01 >= stages[name]["p50_us"], name
    assert stages["app"]["p50_us"] + 0.01 >= total
    for name in ("submit", "resume"):
        assert stages["app"]["p50_us"] + 0.01 >= stages[name]["p50_us"], name
    # Per scatter the stages add up exactly.
    smp = res["samples_ns"]
    for i in range(300):
        parts = smp["queued"][i] + smp["to_first_post"][i] + smp["posting"][i] + smp["in_flight"][i]
        assert parts == smp["total"][i]
        assert smp["submit"][i] + smp["total"][i] + smp["resume"][i] == smp["app"][i]
    assert "to first post" in proc.stdout and "app (await)" in proc.stdout
