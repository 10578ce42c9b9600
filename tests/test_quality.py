"""The static checks are part of the suite: `mypy --strict` over afabric/ and examples/
(configured in pyproject.toml, with typings/ on its path) and `ruff check .` with the
rule set chosen there. Both are test dependencies; each test is skipped, saying so, only
where its tool is missing.

mypy keeps its cache outside the work tree (``${XDG_CACHE_HOME:-~/.cache}/afabric-test/mypy``),
like the rxe kernel and libfabric 2.x: of the ~1650 modules a run analyses, ~1380 are torch's
(examples and afabric.memory import it), which never change between runs, and a clean
clone's cold cache re-analysed them every time (23 s of the suite; 1-2 s warm). The cache
cannot make a check weaker: mypy reuses a module's cached result only when the module's
source hash and every dependency's interface still match, and re-checks the rest; runs of
several work trees share it under a lock."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """Replaces conftest's check here: nothing in this module opens a shm endpoint, so a
    /dev/shm file appearing meanwhile belongs to a concurrent run, which this test must
    neither be blamed for nor delete."""
    yield


def _run_tool(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[test]' brings it)")
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )


def mypy_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "afabric-test" / "mypy"


@pytest.mark.timeout(300)  # a cold mypy cache takes a while on 2 cores
def test_mypy_strict() -> None:
    if importlib.util.find_spec("torch") is None:  # afabric's torch code is checked against its types
        pytest.skip("torch is not installed (bash tests/run.sh --all installs it): mypy needs its types")
    # Files, strictness and the stub path all come from pyproject.toml; only the cache moves.
    cache = mypy_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one run at a time writes the shared cache
        proc = _run_tool("mypy", "--cache-dir", str(cache), timeout=280)
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}"


@pytest.mark.timeout(300)
def test_ruff_check() -> None:
    proc = _run_tool("ruff", "check", ".", "--output-format", "concise", timeout=280)
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}"
