"""`afabric bench kvcache --quick` runs end to end (a prefill process, the decoder here) and
reports every quantity; speed is reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def _bench(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """`afabric bench kvcache --quick ARGS --json`: the JSON document and the printed report."""
    pytest.importorskip("torch")
    out = tmp_path / "kvcache.json"
    proc = subprocess.run(
        [sys.executable, "-m", "afabric.cli", "bench", "kvcache", "--quick", *args, "--json", str(out)],
        check=False, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


@pytest.mark.timeout(200)
def test_bench_kvcache_quick(tmp_path: Path) -> None:
    doc, stdout = _bench(tmp_path, "--provider", "shm")
    assert doc["bench"] == "kvcache" and doc["provider"] == "shm" and doc["page_bytes"] == 32768
    assert doc["modes"] == ["push", "pull"]  # --mode both, the default: a row per mode
    assert [(r["tokens"], r["mode"]) for r in doc["rows"]] == [
        (1024, "push"), (1024, "pull"), (4096, "push"), (4096, "pull"),
    ]  # fmt: skip
    for r in doc["rows"]:
        assert r["pages"] == r["tokens"] // 128
        for key in ("compute_per_layer_ms", "transfer_per_layer_ms", "ttft_local_ms", "ttft_disagg_ms"):
            assert r[key] > 0, key
        assert r["exposed_ms"] >= 0 and 0.0 <= r["hidden_fraction"] <= 1.0
        # the disaggregated request cannot finish before the prefiller's compute did
        assert r["ttft_disagg_ms"] >= r["compute_per_layer_ms"] * doc["model"]["layers"] * 0.99
        assert set(r["samples"]) == {"local", "disagg", "transfer", "exposed", "compute"}
    assert "TTFT disagg" in stdout and "disagg/local" in stdout
    assert " push " in stdout and " pull " in stdout


@pytest.mark.timeout(200)
def test_bench_kvcache_hugepages(tmp_path: Path) -> None:
    """--hugepages: both CPU caches over afabric.host_buffer (cma: copies into huge pages)."""
    doc, stdout = _bench(tmp_path, "--provider", "cma", "--mode", "push", "--hugepages")
    assert doc["hugepages"] is True and doc["provider"] == "cma"
    assert [(r["tokens"], r["mode"]) for r in doc["rows"]] == [(1024, "push"), (4096, "push")]
    assert all(r["transfer_per_layer_ms"] > 0 for r in doc["rows"])
    assert "huge pages: both caches over afabric.host_buffer" in stdout
