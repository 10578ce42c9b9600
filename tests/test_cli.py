"""The ``afabric`` command as a new user meets it, run as a real
subprocess of the venv's ``afabric`` script:

- ``--version``;
- optional packages (torch, cupy, uvloop) missing: exit 2 at once, naming the package and
  how to install it (simulated by a directory on PYTHONPATH whose ``torch`` package raises
  ImportError: a missing optional package, not a transport mock);
- a benchmark's child process that dies (a dependency missing only in the child; a child
  SIGKILLed mid-run): the parent fails at once, with the child's error;
- ``--json -`` writes the document to stdout and the report and progress to stderr;
- output paths refused before a benchmark runs;
- progress lines on stderr when it is not a terminal;
- one set of defaults (provider ``auto``, the same loop) across subcommands;
- the ``py/raw`` column explained where Python beats the raw loop.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest

from afabric.bench import harness, p2p
from afabric.cli import _parser

BIN = Path(sys.executable).parent
AFABRIC = shutil.which("afabric", path=str(BIN)) or ""

# Quick arguments for each benchmark that needs an optional package.
QUICK = {
    "kvcache": ["bench", "kvcache", "--quick"],
    "weights": ["bench", "weights", "--quick", "--trainers", "1", "--inference", "1", "--repeat", "1"],
    "moe": ["bench", "moe", "--quick"],
}

# In spawned children only (multiprocessing's spawn passes --multiprocessing-fork): torch
# cannot be imported, or the process kills itself after $KILL_CHILD_AFTER seconds.
CHILD_SITECUSTOMIZE = '''
import os, signal, sys, threading
if "--multiprocessing-fork" in sys.argv:
    if os.environ.get("KILL_CHILD_AFTER"):
        t = threading.Timer(float(os.environ["KILL_CHILD_AFTER"]), os.kill, (os.getpid(), signal.SIGKILL))
        t.daemon = True
        t.start()
    if os.environ.get("CHILD_WITHOUT_TORCH"):
        class _NoTorch:
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ModuleNotFoundError("No module named 'torch' (in the child only)", name=name)
                return None
        sys.meta_path.insert(0, _NoTorch())
'''


def _run(
    args: list[str], *, env: dict[str, str] | None = None, cwd: Path | None = None, timeout: float = 100
) -> tuple[subprocess.CompletedProcess[str], float]:
    assert AFABRIC, f"no afabric script next to {sys.executable}"
    full_env = dict(os.environ)
    full_env.pop("AFABRIC_PROVIDER", None)
    full_env.update(env or {})
    t0 = time.monotonic()
    proc = subprocess.run(
        [AFABRIC, *args], check=False, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd
    )
    return proc, time.monotonic() - t0


def _missing(tmp_path: Path, *packages: str) -> dict[str, str]:
    """PYTHONPATH with a package of each name whose import fails, as if not installed."""
    root = tmp_path / "missing"
    for name in packages:
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "__init__.py").write_text(f"raise ImportError('simulated: {name} is not installed')\n")
    return {"PYTHONPATH": str(root)}


def _child_hooks(tmp_path: Path, **env: str) -> dict[str, str]:
    root = tmp_path / "hooks"
    root.mkdir(exist_ok=True)
    (root / "sitecustomize.py").write_text(CHILD_SITECUSTOMIZE)
    return {"PYTHONPATH": str(root), **env}


def test_version() -> None:
    proc, _ = _run(["--version"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"afabric {metadata.version('afabric')}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("command", "package", "install"),
    [
        ("kvcache", "torch", "pip install torch"),
        ("weights", "torch", "pip install torch"),
        ("moe", "torch", "pip install torch"),
        ("moe", "cupy", "pip install cupy"),
    ],
)
def test_missing_optional_package_exits_2_at_once(
    tmp_path: Path, command: str, package: str, install: str
) -> None:
    """Before: `bench kvcache` without torch started its child, which died, and the parent
    waited five minutes. Now: exit 2 before anything starts, naming the package."""
    if package == "cupy":
        pytest.importorskip("torch", reason="moe checks torch first")
    proc, took = _run(QUICK[command], env=_missing(tmp_path, package), cwd=tmp_path, timeout=100)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"needs {package}" in proc.stderr and install in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == "", proc.stdout + proc.stderr
    assert took < 30, f"took {took:.1f} s to say so"


@pytest.mark.timeout(60)
def test_explicit_uvloop_without_uvloop_exits_2(tmp_path: Path) -> None:
    proc, took = _run(["bench", "p2p", "--quick", "--loop", "uvloop"], env=_missing(tmp_path, "uvloop"))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "needs uvloop" in proc.stderr and "pip install 'afabric[uvloop]'" in proc.stderr, proc.stderr
    assert proc.stdout == "" and took < 30


@pytest.mark.timeout(150)
def test_child_without_its_dependency_fails_the_parent_at_once(tmp_path: Path) -> None:
    """The prefill process cannot import torch (the parent can): the parent fails at once
    with the child's own error (before: it waited 300 s for the child's address)."""
    pytest.importorskip("torch")
    proc, took = _run(
        ["bench", "kvcache", "--quick", "--provider", "shm"],
        env=_child_hooks(tmp_path, CHILD_WITHOUT_TORCH="1"), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("afabric: error: the benchmark's prefill process"), proc.stderr
    assert "exited with status 1" in last and "ModuleNotFoundError: No module named 'torch'" in last, last
    assert took < 60, f"the parent took {took:.1f} s to notice"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("provider", ["shm", "tcp"])
def test_killed_target_fails_the_parent_at_once(tmp_path: Path, provider: str, shm_cleanup: None) -> None:
    """The p2p target is SIGKILLed while the parent is measuring: the parent stops at once
    and says which process died and how (shm: writes to the dead target never complete; tcp:
    they fail with a transport error, and the target's death is still what is reported)."""
    kill_after = 4.0
    proc, took = _run(
        ["bench", "p2p", "--provider", provider, "--sizes", "4K,64K,1M", "--repeat", "50"],
        env=_child_hooks(tmp_path, KILL_CHILD_AFTER=str(kill_after)), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("afabric: error: the benchmark's target process"), proc.stderr
    assert "was killed by SIGKILL" in last, last
    assert "py GB/s" not in proc.stdout, "results printed although the target died"
    assert took < kill_after + 40, f"the parent took {took:.1f} s to notice"


@pytest.mark.timeout(150)
def test_killed_prefiller_fails_kvcache_at_once(tmp_path: Path, shm_cleanup: None) -> None:
    """`bench kvcache`, the issue's case: its prefill process SIGKILLed mid-run. The decoder
    does not wait its 60 s peer timeout, nor for a local prefill running in a thread."""
    pytest.importorskip("torch")
    kill_after = 9.0
    proc, took = _run(
        ["bench", "kvcache", "--provider", "tcp", "--tokens", "4K,32K", "--repeat", "3"],
        env=_child_hooks(tmp_path, KILL_CHILD_AFTER=str(kill_after)), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("afabric: error: the benchmark's prefill process"), proc.stderr
    assert "was killed by SIGKILL" in last, last
    assert took < kill_after + 30, f"the parent took {took:.1f} s to notice"


@pytest.mark.timeout(150)
def test_json_dash_and_progress_when_piped(tmp_path: Path) -> None:
    """`--json -`: stdout is the JSON document alone (before: a file named '-'); the report
    and the progress lines (before: silence when piped) are on stderr."""
    proc, _ = _run(
        ["bench", "p2p", "--quick", "--sizes", "4K", "--repeat", "1", "--json", "-"],
        cwd=tmp_path, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["bench"] == "p2p" and doc["rows"], doc
    assert not (tmp_path / "-").exists()
    assert "afabric bench p2p — provider" in proc.stderr and "py/raw:" in proc.stderr, proc.stderr
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("afabric: ") and "/" in ln]
    assert any("write 4 KiB" in ln for ln in progress) and progress[-1].split(" (")[0].endswith("latency 8 B")
    assert "\r" not in proc.stderr and "[#" not in proc.stderr, "a terminal's bar drawn on a pipe"
    # the default engine's transports were resolved once, said, and the route to the target named
    assert doc["provider"] == "auto" and doc["route"] == "cma" and "auto opened cma" in proc.stderr
    assert "route to the target: cma" in proc.stderr

    plan, _ = _run(
        ["weights", "plan", "--model", "deepseek-v3", "--layers", "2", "--json", "-"], cwd=tmp_path
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["model"] and "projected" in plan.stderr
    assert not (tmp_path / "-").exists()


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    "args",
    [
        ["bench", "p2p", "--quick"],
        ["bench", "trigger", "--quick"],
        ["bench", "overhead", "--quick"],
        ["bench", "soak", "--minutes", "0.1"],
        QUICK["kvcache"],
        QUICK["weights"],
        ["weights", "plan", "--model", "deepseek-v3", "--layers", "2"],
    ],
    ids=lambda a: " ".join(a[:2]),
)
def test_output_paths_checked_before_the_run(tmp_path: Path, args: list[str]) -> None:
    """Before: a traceback after the whole run. Now: exit 2 before anything starts."""
    bad = [
        ("--json", str(tmp_path / "no such dir" / "r.json"), "does not exist"),
        ("--json", str(tmp_path), "is a directory"),
    ]
    if args[1] in ("p2p", "trigger", "overhead"):
        bad.append(("--plot", str(tmp_path / "no such dir" / "r.png"), "does not exist"))
    for option, path, why in bad:
        proc, took = _run([*args, option, path], cwd=tmp_path, timeout=60)
        assert proc.returncode == 2, (option, path, proc.stdout + proc.stderr)
        assert f"{option} {path}: " in proc.stderr and why in proc.stderr, proc.stderr
        assert proc.stdout == "" and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
        assert took < 30


def test_one_set_of_defaults() -> None:
    """Every command that takes --provider defaults to `auto`, every --loop to the same loop."""
    loop = harness.default_loop()
    parser = _parser()
    for name in ("p2p", "trigger", "overhead", "kvcache", "soak", "weights", "moe"):
        ns = parser.parse_args(["bench", name])
        assert ns.provider == "auto", name
        if name != "moe":  # moe's ranks run no event loop
            assert ns.loop == loop, name


def _row(size: int, py_s: list[float], raw_s: list[float]) -> p2p.Row:
    row = p2p.Row("write", size, 1, 16)
    p2p._fill(row, py_s, raw_s, size)
    return row


def test_py_raw_explained_where_python_wins() -> None:
    slow_py = _row(4096, [2e-5, 2e-5], [1e-5, 1e-5])  # Python at half the raw rate
    assert p2p.py_raw_note([slow_py])[0].startswith("py/raw: ")
    assert len(p2p.py_raw_note([slow_py])) == 1  # nothing to explain
    fast_py = _row(1 << 20, [1.0e-4, 1.1e-4, 0.9e-4], [1.2e-4, 1.3e-4, 1.0e-4])
    assert fast_py.ratio > 1
    note = p2p.py_raw_note([slow_py, fast_py])
    assert "not a ceiling" in note[1] and "py/raw > 1" in note[1]
    [spread] = note[2:]
    assert spread.startswith("  write 1 MiB: py ") and "raw" in spread and "(3 repeats)" in spread
    text = p2p.render([slow_py, fast_py], [], "header")
    assert "not a ceiling" in text
    # the Markdown report of the same rows says it too
    from dataclasses import asdict

    from afabric.bench import report

    doc = {"bench": "p2p", "rows": [asdict(r) | {"ratio": r.ratio} for r in (slow_py, fast_py)]}
    [line] = [ln for ln in report._p2p(doc) if ln.startswith("Python/raw above 1")]
    assert "(1 MiB)" in line and "not a ceiling" in line
    assert not any("Python/fi" in ln for ln in report._p2p(doc))  # no --fabtests: no such column


def test_report_shows_the_fabtests_ratio_and_the_pattern() -> None:
    """A p2p result run with --fabtests: the report page has fi_rma_bw's column and the
    API's share of it per row, and names the access pattern the rows ran in."""
    from dataclasses import asdict

    from afabric.bench import report

    row = _row(1 << 20, [0.001] * 3, [0.001] * 3)  # 1.05 GB/s both
    row.fi_gbps = 2.0
    doc = {"bench": "p2p", "rows": [asdict(row) | {"ratio": row.ratio}], "pattern": "fixed"}
    table = report._p2p(doc)
    assert "Python/fi" in table[0] and "fi_rma_bw GB/s" in table[0]
    assert "| 2.00 | 0.52 |" in table[2]
    assert "-U" not in table[0]  # no delivery-complete reference measured: no such column
    row.fi_dc_gbps = 1.05
    doc["rows"] = [asdict(row) | {"ratio": row.ratio}]
    table = report._p2p(doc)
    assert "fi_rma_bw -U GB/s" in table[0] and "Python/fi -U" in table[0]
    assert "| 2.00 | 0.52 | 1.05 | 1.00 |" in table[2]
    assert "batch" not in table[0]  # no batch row measured: no such column
    row.batch_gbps = 1.8  # write_many in fi_rma_bw's pattern, beside the rest
    doc["rows"] = [asdict(row) | {"ratio": row.ratio}]
    table = report._p2p(doc)
    assert "batch GB/s" in table[0] and "batch/fi" in table[0]
    assert "| 2.00 | 0.52 | 1.05 | 1.00 | 1.80 | 0.90 |" in table[2]
    text = p2p.render([row, p2p.Row("read", 4096, 1, 64, 1.0, 1.0)], [], "header")
    head, write, read = text.splitlines()[2:5]
    assert head.split()[-2:] == ["batch", "bat/fi"] and write.split()[-2:] == ["1.80", "0.90"]
    assert len(write.split()) == 15 and len(read.split()) == 9  # the read row: no fi, no batch
    assert "batch: the Python API posting a window of writes" in text and "fi_rma_bw's own loop" in text
    row.fi_gbps = row.fi_dc_gbps = 0.0  # no --fabtests: the batch is explained without fi_rma_bw
    text = p2p.render([row], [], "header")
    assert "batch: the Python API" in text and "fi_rma_bw" not in text
    assert "--pattern fixed" in report._reconstructed_command(doc)


def test_progress_lines_are_rate_limited(monkeypatch: pytest.MonkeyPatch) -> None:
    """Piped, a sweep with thousands of advances prints a handful of lines, not thousands."""
    import io

    from afabric.bench import progress

    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])  # the module progress uses
    out = io.StringIO()
    bar = progress.Progress(1000, stream=out)
    bar.step("mode a")
    for _ in range(999):
        clock[0] += 0.05  # 50 s in all
        bar.advance()
    bar.advance()
    lines = out.getvalue().splitlines()
    assert 5 <= len(lines) <= 8, lines
    assert lines[-1] == "afabric: 1000/1000 done (50.0 s)"


def test_check_outputs_in_process(tmp_path: Path) -> None:
    ok = argparse.Namespace(json=str(tmp_path / "r.json"), plot=None)
    harness.check_outputs(ok)
    assert not (tmp_path / "r.json").exists(), "checking must not create the file"
    harness.check_outputs(argparse.Namespace(json="-", plot=None))
    with pytest.raises(harness.CommandError, match="give a path"):
        harness.check_outputs(argparse.Namespace(json=None, plot="-"))


PROGRESS_LINE = re.compile(r"^afabric: (\d+)/(\d+) (.*) \((\d+\.\d) s(, ETA [^)]+)?\)$")


@pytest.mark.timeout(400)
def test_default_p2p_is_quick_with_heartbeat_and_eta(tmp_path: Path) -> None:
    """`afabric bench p2p` as the README's first command runs it: the quick sweep (before:
    the full one, 447.7 s on the quiet 2-core machine, its 16-64 MiB rows silent for a
    minute or more). Progress at least every 10 s, each line with an ETA; the header names
    the sweep and how to run the full one. Its duration is printed, not judged."""
    proc, took = _run(["bench", "p2p"], cwd=tmp_path, timeout=380)
    print(f"\nafabric bench p2p (default): {took:.1f} s")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sweep quick, 3 repeats" in proc.stdout and "--full" in proc.stdout, proc.stdout
    assert re.search(r"^write +64 MiB", proc.stdout, re.M) is None, "a --full row in the default run"
    lines = [m for ln in proc.stderr.splitlines() if (m := PROGRESS_LINE.match(ln))]
    assert lines, proc.stderr
    times = [0.0] + [float(m.group(4)) for m in lines]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert max(gaps) <= 10.0, f"progress silent for {max(gaps):.1f} s: {proc.stderr}"
    assert all(m.group(5) for m in lines), "a progress line without an ETA"


def test_full_sweep_is_the_option() -> None:
    """--full is the former default (every size, fi_rma_bw's counts, 5 repeats); the default
    is the quick sweep, its estimated cost a small part of the full one."""
    parser = _parser()
    quick = parser.parse_args(["bench", "p2p"])
    full = parser.parse_args(["bench", "p2p", "--full"])
    assert p2p.sweep(quick) == "quick" and quick.quick
    assert p2p.sweep(full) == "full" and not full.quick
    for ns, repeat in ((quick, 3), (full, 5)):
        ns.repeat = repeat
    sizes = {n: (p2p.QUICK_CONTIG, p2p.QUICK_PAGES) if ns.quick else (p2p.CONTIG_SIZES, p2p.PAGE_SIZES)
             for n, ns in (("quick", quick), ("full", full))}  # fmt: skip
    cost = {n: sum(p2p.step_costs(ns, *sizes[n])) for n, ns in (("quick", quick), ("full", full))}
    assert cost["quick"] < cost["full"] / 8, cost
    with pytest.raises(harness.CommandError, match="--quick and --full"):
        p2p.sweep(parser.parse_args(["bench", "p2p", "--quick", "--full"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "usage", "why"),
    [
        (["bench", "p2p", "--sizs", "4K"], "afabric bench p2p", "unrecognized arguments: --sizs 4K"),
        (["bench", "p2p", "--repeat", "0"], "afabric bench p2p", "--repeat: must be at least 1"),
        (["bench", "p2p", "--sizes", "4K,0"], "afabric bench p2p", "--sizes: sizes must be at least 1 byte"),
        (["bench", "p2p", "--provider", "foo"], "afabric bench p2p", "no provider 'foo' is installed"),
        (["bench", "kvcache", "--repeat", "-1"], "afabric bench kvcache", "--repeat: must be at least 1"),
        (["bench", "trigger", "--iterations", "0"], "afabric bench trigger", "must be at least 1"),
        (["weights", "plan", "--model", "deepseek-v3", "--bogus"], "afabric weights plan", "--bogus"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_usage_errors_exit_2_with_the_subcommands_usage(args: list[str], usage: str, why: str) -> None:
    """A bad option exits 2 (docs/api/cli.md) with the usage of the subcommand it was given to
    (before: a mistyped option printed the top-level usage; --provider foo exited 1;
    --repeat 0 and --sizes 0 ran)."""
    proc, took = _run(args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"usage: {usage} "), proc.stderr
    assert f"{usage}: error: " in proc.stderr and why in proc.stderr, proc.stderr
    assert proc.stdout == "" and took < 30


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["bench", "p2p", "--quick", "--full"], "--quick and --full"),
        (["bench", "p2p", "--sizes", "256M"], "larger than the target's region"),
        (["bench", "p2p", "--provider", "efa"], "--provider efa: unavailable here"),
    ],
)
def test_unusable_options_exit_2_before_the_run(args: list[str], why: str) -> None:
    if why.startswith("--provider") and registry_available("efa"):
        pytest.skip("efa is usable here")
    proc, took = _run(args, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("afabric: error: ") and why in proc.stderr, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr and took < 30


def registry_available(name: str) -> bool:
    from afabric import registry

    return name in registry.names() and registry.probe(name).available


def test_heartbeat_shows_a_long_step_again() -> None:
    """A step that lasts (a 64 MiB row of --full: a minute and more) is shown again every
    `heartbeat` seconds by the bar's own thread, each time with the ETA."""
    import io

    from afabric.bench import progress

    out = io.StringIO()
    bar = progress.Progress(2, stream=out, weights=[1.0, 1.0], heartbeat=0.2)
    bar.step("long row")
    deadline = time.monotonic() + 30
    while out.getvalue().count("\n") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    bar.close()
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3, lines
    assert all(ln.startswith("afabric: 0/2 long row (") and ", ETA " in ln for ln in lines), lines
    n = len(lines)
    time.sleep(0.5)
    assert len(out.getvalue().splitlines()) == n, "the heartbeat went on after close()"
