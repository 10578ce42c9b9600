"""examples/kvcache_disagg.py runs as written: a prefill and a decode process, a real
attention-layer stack in torch, every transferred KV page bit-identical to the local one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(200)
@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_kvcache_example_runs_as_written(provider: str) -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "kvcache_disagg.py"), "--provider", provider],
        check=False,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode: 6 concurrent requests on cpu, all bit-identical" in proc.stdout
    assert proc.stdout.count("KV cache bit-identical") == 6
    assert "prefill: served 6 requests on cpu" in proc.stdout
