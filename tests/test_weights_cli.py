"""The weight transfer commands run as a user runs them: `afabric weights plan` for a
published model, `afabric bench weights --quick` with real processes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def _afabric(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "afabric.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.timeout(120)
def test_weights_plan_projection(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = _afabric("weights", "plan", "--model", "qwen3-235b", "--layers", "2", "--trainers", "32",
                    "--inference", "16", "--nic-gbps", "400", "--json", str(out), timeout=100)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "projected" in proc.stdout
    r = json.loads(out.read_text())
    p2p, rank0 = r["p2p"], r["rank0"]
    # every inference rank gets its share, all the bytes pass through inference rank 0 in rank-0
    assert p2p["busiest_nic"] == max(p2p["trainer_max"], p2p["inference_max"])
    assert rank0["scatter_from_inference0"] > p2p["inference_max"] * 14
    assert p2p["trainer_max"] <= 1.1 * p2p["trainer_mean"]
    assert r["ratio"] > 10


def test_weights_plan_unknown_model() -> None:
    proc = _afabric("weights", "plan", "--model", "gpt-5", timeout=60)
    assert proc.returncode == 1 and "unknown model" in proc.stderr


@pytest.mark.timeout(240)
def test_bench_weights_quick(tmp_path: Path) -> None:
    """Shards as LocalShard tensors (the path --device cuda takes), tcp between processes."""
    pytest.importorskip("torch", reason="torch is not installed (bash tests/run.sh --all installs it)")
    out = tmp_path / "bench.json"
    proc = _afabric("bench", "weights", "--quick", "--trainers", "2", "--inference", "1", "--repeat", "1",
                    "--provider", "tcp", "--shards", "local", "--json", str(out), timeout=220)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ratio" in proc.stdout
    r = json.loads(out.read_text())
    assert len(r["p2p_seconds"]) == 1 and len(r["rank0_seconds"]) == 1
    assert sum(r["sent"].values()) == sum(r["received"].values()) > 0
