"""`afabric bench p2p` end to end, and `--fabtests DIR`: libfabric's own fi_rma_bw and
fi_rdm_pingpong beside afabric's rows.

The fabtests binaries are not part of afabric; their columns are checked only where the
development checkout has them beside it (../shared/tools/fabtests).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# ../shared beside the checkout (a worktree under wt/ has it one level further up)
FABTESTS = next(
    (p for p in (ROOT.parent / "shared/tools/fabtests", ROOT.parent.parent / "shared/tools/fabtests")
     if (p / "fi_rma_bw").is_file() and (p / "fi_rdm_pingpong").is_file()),
    None,
)  # fmt: skip


def _p2p(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "afabric.cli", "bench", "p2p", *args],
        check=False, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_missing_fabtests_dir_is_refused_before_the_run(tmp_path: Path) -> None:
    proc = _p2p("--provider", "shm", "--quick", "--fabtests", str(tmp_path / "nowhere"), timeout=60)
    assert proc.returncode == 2
    assert "--fabtests" in proc.stderr and "not a directory" in proc.stderr
    (tmp_path / "fi_rma_bw").write_text("")  # present but not executable, and no pingpong
    proc = _p2p("--provider", "shm", "--quick", "--fabtests", str(tmp_path), timeout=60)
    assert proc.returncode == 2
    assert "missing or not executable" in proc.stderr


@pytest.mark.timeout(400)
def test_bench_p2p_quick(tmp_path: Path) -> None:
    """The quick p2p run, every row kind; where ../shared has the fabtests binaries, with
    libfabric's own loops beside afabric's rows (one run does both: this is the suite's
    most expensive benchmark)."""
    out = tmp_path / "p2p.json"
    args = ["--provider", "shm", "--quick", "--sizes", "64K", "--repeat", "1", "--json", str(out)]
    proc = _p2p(*args, *(["--fabtests", str(FABTESTS)] if FABTESTS else []), timeout=380)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    kinds = {(r["kind"], r["size"]) for r in doc["rows"]}
    assert ("write", 65536) in kinds and ("read", 65536) in kinds
    assert any(k == "paged" for k, _ in kinds)
    for r in doc["rows"]:
        assert r["py_gbps"] > 0 and r["raw_gbps"] > 0
    assert doc["latency"][0]["p50_us"] > 0
    assert "py/raw" in proc.stdout
    if FABTESTS is None:
        assert "fi_rma_bw" not in proc.stdout
        return
    assert "fi_rma_bw" in proc.stdout and "py/fi" in proc.stdout
    assert "fi_rdm_pingpong" in proc.stdout
    (write,) = [r for r in doc["rows"] if r["kind"] == "write"]
    assert write["window"] == 64 and write["fi_gbps"] > 0  # fi_rma_bw ran at afabric's size and window
    assert all(r["fi_gbps"] == 0 for r in doc["rows"] if r["kind"] == "paged")
    reads = [r for r in doc["rows"] if r["kind"] == "read"]  # fi_rma_bw -o read beside them
    assert reads and all(r["fi_gbps"] > 0 for r in reads)
    assert doc["latency"][0]["fi_pingpong_us"] > 0
