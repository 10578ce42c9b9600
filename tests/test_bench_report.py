"""Reports people look at: `--plot` on the benchmarks, `afabric bench report`, the progress bar.

The benchmarks run for real (small: shm, a few sizes, 100 trigger iterations) in
subprocesses, as a user runs them; what is checked is that the PNGs are real PNGs and the
Markdown page shows both results with their plots. Speed is never asserted."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from afabric.bench.progress import Progress

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# Runs the CLI as if matplotlib were not installed (an import of it fails).
NO_MATPLOTLIB = (
    "import sys; sys.modules['matplotlib'] = None; "
    "from afabric.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _afabric(*args: str, timeout: float = 110) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "afabric.cli", *args],
        check=False, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def _check_png(path: Path) -> None:
    assert path.is_file(), f"{path} was not written"
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 10_000, f"{path} is only {len(data)} bytes: an empty figure?"


@pytest.mark.timeout(300)
def test_plots_and_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="plots need matplotlib (the test extra installs it)")
    p2p = _afabric(
        "bench", "p2p", "--provider", "shm", "--quick", "--sizes", "4K,1M", "--repeat", "1",
        "--json", str(tmp_path / "p2p.json"), "--plot", str(tmp_path / "p2p.png"),
    )  # fmt: skip
    assert p2p.returncode == 0, p2p.stderr
    assert "[#" not in p2p.stderr and "[." not in p2p.stderr, "progress bar drawn on a pipe"
    trig = _afabric(
        "bench", "trigger", "--quick", "--iterations", "100",
        "--json", str(tmp_path / "trigger.json"), "--plot", str(tmp_path / "trigger.png"),
    )  # fmt: skip
    assert trig.returncode == 0, trig.stderr
    assert "[#" not in trig.stderr and "[." not in trig.stderr, "progress bar drawn on a pipe"
    _check_png(tmp_path / "p2p.png")
    _check_png(tmp_path / "trigger.png")

    docs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("p2p", "trigger")}
    assert docs["p2p"]["bench"] == "p2p" and docs["trigger"]["bench"] == "trigger"
    for doc in docs.values():
        assert doc["command"].startswith(f"afabric bench {doc['bench']} "), doc["command"]
    (tmp_path / "notes.json").write_text('{"not": "a result"}')

    rep = _afabric("bench", "report", str(tmp_path), timeout=120)
    assert rep.returncode == 0, rep.stderr
    page = (tmp_path / "README.md").read_text()
    assert "## p2p:" in page and "## trigger:" in page
    assert "](p2p.png)" in page and "](trigger.png)" in page  # linked relatively, next to the JSON
    assert "](p2p.json)" in page and "](trigger.json)" in page
    assert docs["p2p"]["command"] in page and docs["trigger"]["command"] in page
    assert "| write | 4 KiB |" in page and "| write | 1 MiB |" in page  # p2p's table
    assert "| triggered | 100 |" in page and "| python | 100 |" in page  # trigger's table
    assert "notes.json" in page  # listed as not a result, not fatal
    lat = docs["p2p"]["latency"][0]
    assert f"(raw C loop: p50 {lat['raw_p50_us']:.1f}, p99 {lat['raw_p99_us']:.1f}, mean " in page
    _check_png(tmp_path / "p2p.png")  # redrawn by the report from the JSON
    _check_png(tmp_path / "trigger.png")

    # A result written before the raw loop timed each write holds its mean as raw_p50_us.
    lat_v1 = {"size": 8, "p50_us": 9.0, "p99_us": 20.0, "raw_p50_us": 4.25, "samples": 10}
    old = dict(docs["p2p"], latency=[lat_v1])
    (tmp_path / "old" / "p2p.json").parent.mkdir()
    (tmp_path / "old" / "p2p.json").write_text(json.dumps(old))
    rep = _afabric("bench", "report", str(tmp_path / "old"), "--no-plots", timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "(raw C loop: 4.2 µs mean; 10 samples)" in (tmp_path / "old" / "README.md").read_text()

    # Elsewhere with -o: the links are relative to the page.
    out = tmp_path / "site" / "bench.md"
    out.parent.mkdir()
    rep = _afabric("bench", "report", str(tmp_path), "-o", str(out), "--no-plots", timeout=120)
    assert rep.returncode == 0, rep.stderr
    other = out.read_text()
    assert "](../p2p.json)" in other and "](../trigger.json)" in other

    # Without matplotlib the report is still written, without plots and saying why.
    nompl = subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, "bench", "report", str(tmp_path), "-o", str(tmp_path / "R.md")],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert nompl.returncode == 0, nompl.stderr
    assert "pip install 'afabric[plot]'" in nompl.stderr
    text = (tmp_path / "R.md").read_text()
    assert "## p2p:" in text and "](p2p.png)" not in text and "afabric[plot]" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bench", ["p2p", "trigger"])
def test_plot_without_matplotlib_is_a_message(tmp_path: Path, bench: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", NO_MATPLOTLIB, "bench", bench, "--quick", "--plot", str(tmp_path / "x.png")],
        check=False, capture_output=True, text=True, timeout=50,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'afabric[plot]'" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == "", "the benchmark ran although its plot could not be drawn"
    assert not (tmp_path / "x.png").exists()


def test_report_of_an_empty_directory_fails_clearly(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text("[1, 2]")
    proc = _afabric("bench", "report", str(tmp_path), timeout=50)
    assert proc.returncode == 1
    assert "no benchmark results" in proc.stderr and "Traceback" not in proc.stderr


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar() -> None:
    tty = _Tty()
    bar = Progress(4, stream=tty, width=10)
    bar.step("write 8 B")
    assert tty.getvalue().endswith("\r[..........] 0/4 write 8 B")
    bar.advance()
    bar.step("write 1 MiB")
    assert tty.getvalue().endswith("\r[##........] 1/4 write 1 MiB")
    bar.advance(3)
    assert bar.line() == "[##########] 4/4 write 1 MiB"
    bar.close()
    assert tty.getvalue().endswith("\r" + " " * len(bar.line()) + "\r")  # wiped: output starts clean

    pipe = io.StringIO()  # not a terminal: a plain line per step, no bar, no carriage return
    with Progress(3, stream=pipe) as plain:
        plain.step("write 8 B")
        plain.advance()  # within LINE_EVERY_S of the last line: nothing
        plain.step("write 1 MiB")
        plain.advance(2)
    lines = pipe.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == [
        "afabric: 0/3 write 8 B", "afabric: 1/3 write 1 MiB", "afabric: 3/3 done"
    ], lines
    assert "\r" not in pipe.getvalue() and "[#" not in pipe.getvalue()

    quiet = io.StringIO()
    with Progress(3, stream=quiet, lines=False) as bar2:
        bar2.step("x")
        bar2.advance()
    assert quiet.getvalue() == ""
