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

import ast
import fcntl
import importlib.util
import os
import re
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


# ---- no development history in the product ----

_ORDINALS = (
    "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
    "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|"
    "thirtieth|twenty[- ]?(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)|"
    r"\d+(?:st|nd|rd|th)"
)
# What a lab notebook leaves behind: development sessions by ordinal, issue numbers,
# experiment folders and logs, the old benchmark diary, comments citing README sections.
HISTORY = {
    "a session ordinal": re.compile(rf"\b(?:{_ORDINALS})[ -]session\b", re.IGNORECASE),
    "an issue number": re.compile(r"\bissues? ?#?\d+", re.IGNORECASE),
    "an experiment folder": re.compile(r"docs/bench/|\bperop/|\bissue\d+/"),
    "the benchmark diary": re.compile(r"BENCHMARKS\.md"),
    "a README section cited": re.compile(r"\(README[,:)]|README \"|; README\)"),
}
# Experiment logs cited by path or by name (a tool writing its own output under $OUT or
# /tmp is not history: only the product's text is scanned for these).
LOG_CITED = re.compile(r"`[\w.-]+\.log`|(?:docs|bench|tools)/[\w./-]*\.log\b")
PRODUCT = ("afabric/", "shim/", "providers/", "docs/", "tools/", "examples/", "README.md", "CHANGELOG.md")
TEXT_SUFFIXES = {".py", ".c", ".h", ".cu", ".md", ".sh", ".toml", ".yml", ".yaml", ".txt", ".pyi", ".cfg", ""}


def _tracked() -> list[str]:
    proc = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"not a git checkout: {proc.stderr.strip()}")
    return [p for p in proc.stdout.split("\0") if p]


def test_no_development_history() -> None:
    """The tree is a product, not a lab notebook: no session ordinals, issue numbers,
    experiment folders or logs in any tracked file's name or text (this file excepted: it
    holds the patterns). A comment that justifies a constant cites the docs page or the
    benchmark command instead."""
    found: list[str] = []
    for path in _tracked():
        if path.endswith(".log"):
            found.append(f"{path}: a log file is tracked")
        for what, pattern in HISTORY.items():
            if pattern.search(path):
                found.append(f"{path}: {what} in the file's name")
        if path == "tests/test_quality.py" or Path(path).suffix not in TEXT_SUFFIXES:
            continue
        try:
            text = (ROOT / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, FileNotFoundError, IsADirectoryError):
            continue
        checks = dict(HISTORY)
        if path.startswith(PRODUCT):
            checks["an experiment log cited"] = LOG_CITED
        for n, line in enumerate(text.splitlines(), 1):
            for what, pattern in checks.items():
                m = pattern.search(line)
                if m:
                    found.append(f"{path}:{n}: {what}: {m.group(0)!r}")
    assert not found, "development history in the tree:\n" + "\n".join(found)


def test_benchmarks_reach_below_the_api_only_through_raw() -> None:
    """The benchmarks use the public API; afabric/bench/raw.py is the one module that reads
    an engine's private state (the raw C loop, first-post stamps, the timed watcher store,
    the shim's path). Any other bench module importing a private module or touching a
    private attribute of something not its own fails."""
    offenders = []
    for path in sorted((ROOT / "afabric" / "bench").glob("*.py")):
        if path.name == "raw.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            # imports from afabric outside bench/ (``from .. import x``, ``from ..x import y``)
            outside = isinstance(node, ast.ImportFrom) and (
                node.level >= 2 or (node.level == 0 and (node.module or "").startswith("afabric."))
            )
            if isinstance(node, ast.ImportFrom) and outside:
                names = [node.module or "", *(alias.name for alias in node.names)]
                private = [n for n in names if any(part.startswith("_") for part in n.split("."))]
                if private:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: imports {', '.join(private)}")
            elif (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            ):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not offenders, "private state reached outside afabric/bench/raw.py:\n" + "\n".join(offenders)
