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

import numpy as np
import pytest

from afabric import Engine
from afabric.bench import p2p
from afabric.bench.raw import RawLoop

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
        # write rows also ran write_many in fi_rma_bw's pattern; nothing else did
        assert (r["batch_gbps"] > 0) == (r["kind"] == "write"), r
    lat = doc["latency"][0]
    assert lat["p50_us"] > 0
    # the raw C loop timed each of its writes: a distribution, like the Python column's
    assert 0 < lat["raw_p50_us"] <= lat["raw_p99_us"] and lat["raw_mean_us"] > 0
    assert f"raw C loop: p50 {lat['raw_p50_us']:.1f}, p99 {lat['raw_p99_us']:.1f}" in proc.stdout
    assert "py/raw" in proc.stdout
    if FABTESTS is None:
        assert "fi_rma_bw" not in proc.stdout
        return
    assert "fi_rma_bw" in proc.stdout and "py/fi" in proc.stdout
    assert "fi_rdm_pingpong" in proc.stdout
    (write,) = [r for r in doc["rows"] if r["kind"] == "write"]
    assert write["window"] == 64 and write["fi_gbps"] > 0  # fi_rma_bw ran at afabric's size and window
    assert write["fi_dc_gbps"] > 0 and "fi -U" in proc.stdout  # and its delivery-complete -U beside it
    assert all(r["fi_gbps"] == 0 for r in doc["rows"] if r["kind"] == "paged")
    reads = [r for r in doc["rows"] if r["kind"] == "read"]  # fi_rma_bw -o read beside them
    assert reads and all(r["fi_gbps"] > 0 and r["fi_dc_gbps"] == 0 for r in reads)
    assert doc["latency"][0]["fi_pingpong_us"] > 0


@pytest.mark.timeout(300)
def test_bench_p2p_hugepages(tmp_path: Path) -> None:
    """--hugepages: both regions from afabric.host_buffer, said in the header and the JSON."""
    out = tmp_path / "p2p.json"
    args = ["--provider", "cma", "--quick", "--sizes", "1M", "--repeat", "1", "--pattern", "fixed"]
    proc = _p2p(*args, "--hugepages", "--json", str(out), timeout=280)
    assert proc.returncode == 0, proc.stderr
    assert "huge pages: both regions from afabric.host_buffer" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["hugepages"] is True and doc["pattern"] == "fixed"
    assert all(r["py_gbps"] > 0 and r["raw_gbps"] > 0 for r in doc["rows"])


@pytest.mark.parametrize("pattern", ["fixed", "span"])
async def test_pattern_puts_the_rows_where_it_says(pattern: str) -> None:
    """--pattern fixed rewrites one buffer of the row's size at offset 0 (fi_rma_bw's
    pattern, for a like-for-like py/fi); span rotates slot by slot through the region.
    Checked on the target's bytes after each of the Python lanes, the Python batches
    (write_many) and the raw loop, each run alone."""
    size, n = 4096, 96
    async with Engine("shm") as writer, Engine("shm") as target:
        src = np.full(p2p.REGION, 7, dtype=np.uint8)
        dst = np.zeros(n * size * 2, dtype=np.uint8)
        desc = target.register(dst).descriptor
        slots = p2p._Slots(writer, src, writer.register(src), pattern)
        mr, span = slots.region(size), slots.span(size)
        for how in ("lanes", "batches", "raw"):
            dst[:] = 0
            if how == "lanes":
                await p2p._py_writes(writer, mr, desc, size, 8, n, span=span)
            elif how == "batches":
                await p2p._py_batches(writer, mr, desc, size, 8, n, span)
            else:
                RawLoop(writer, mr, desc).write(size, 8, n)
            touched = np.flatnonzero(dst.reshape(-1, size).any(axis=1))
            if pattern == "fixed":
                assert span == 1 and touched.tolist() == [0], how
            else:
                assert span == p2p.REGION // size and len(touched) >= n, how  # each write its own slot
            assert set(np.unique(dst[touched[0] * size : (touched[0] + 1) * size]).tolist()) == {7}, how
        slots.close()
