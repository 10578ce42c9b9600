"""`afabric bench trigger` runs end to end: a target process, both modes, the JSON report.
Speed is reported, never asserted; what is checked is that the measurement is sound."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(150)
def test_bench_trigger_quick(tmp_path: Path) -> None:
    out = tmp_path / "trigger.json"
    proc = subprocess.run(
        [sys.executable, "-m", "afabric.cli", "bench", "trigger", "--quick", "--loop", "asyncio",
         "--provider", "shm", "--json", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=110,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert doc["bench"] == "trigger" and doc["provider"] == "shm"
    assert doc["iterations"] == 300
    assert doc["target"].startswith("all ") and doc["target"].endswith(" writes arrived")
    for mode in ("triggered", "python"):
        m = doc["modes"][mode]
        assert m["samples"] == 300, mode
        assert len(m["samples_ns"]) == 300, mode
        # A write cannot be posted before the change that releases it: a stamp earlier than
        # its bump means the shim's first-post time is not taken when the post happens.
        assert m["before_change"] == 0, f"{mode}: {m['before_change']} first posts stamped before their bump"
        assert m["p50_us"] > 0, mode
        assert m["min_us"] <= m["p50_us"] <= m["p99_us"] <= m["p999_us"] <= m["max_us"], mode
    assert set(doc["ratio_python_over_triggered"]) == {"p50", "p99", "p99.9"}
    assert "python/triggered" in proc.stdout
