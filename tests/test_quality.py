"""The static checks are part of the suite: `mypy --strict` over afabric/ and examples/
(configured in pyproject.toml, with typings/ on its path) and `ruff check .` with the
rule set chosen there. Both are test dependencies; each test is skipped, saying so, only
where its tool is missing."""

from __future__ import annotations

import importlib.util
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


@pytest.mark.timeout(300)  # a cold mypy cache takes a while on 2 cores
def test_mypy_strict() -> None:
    # No arguments: files, strictness and the stub path all come from pyproject.toml.
    proc = _run_tool("mypy", timeout=280)
    assert proc.returncode == 0, f"mypy found problems:\n{proc.stdout}{proc.stderr}"


@pytest.mark.timeout(300)
def test_ruff_check() -> None:
    proc = _run_tool("ruff", "check", ".", "--output-format", "concise", timeout=280)
    assert proc.returncode == 0, f"ruff found problems:\n{proc.stdout}{proc.stderr}"
