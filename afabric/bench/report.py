"""`afabric bench report DIR`: one Markdown page from the benchmark results in a directory.

Every ``*.json`` in DIR whose top-level ``bench`` key names a benchmark (``p2p``, ``trigger``,
``overhead``: what ``--json`` writes) becomes a section: a header with the command, provider,
machine and date, a Markdown table of its key numbers, and its plot, drawn by
:mod:`afabric.bench.plots` from the same document, written next to the JSON as
``<name>.png`` and linked relatively. Other JSON files are listed as skipped. Without
matplotlib the page is written without plots, saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import harness, plots

__all__ = [
    "Result",
    "build",
    "check_outputs",
    "command_line",
    "load",
    "main",
    "render",
    "section",
    "wants_doc",
    "write_outputs",
]

Doc = Mapping[str, Any]
KNOWN = ("p2p", "trigger", "overhead")


@dataclass
class Result:
    path: Path
    doc: dict[str, Any]

    @property
    def bench(self) -> str:
        return str(self.doc.get("bench"))


def command_line(args: argparse.Namespace) -> str | None:
    """The command line that ran a benchmark, for its JSON document: ``afabric`` and the
    arguments the CLI parsed (``args.argv``, set by :func:`afabric.cli.main`); None when the
    benchmark was started some other way."""
    argv = getattr(args, "argv", None)
    if argv is None:
        return None
    return shlex.join(["afabric", *map(str, argv)])


def check_outputs(args: argparse.Namespace) -> None:
    """Before a benchmark runs: raise :class:`afabric.bench.harness.CommandError` for an
    output (``args.json``, ``args.plot``) that could not be written after the run (a missing
    directory, a plot without matplotlib), rather than after the run."""
    harness.check_outputs(args)


def wants_doc(args: argparse.Namespace) -> bool:
    """Whether a benchmark must build its JSON document: ``--json`` or ``--plot`` was given."""
    return bool(getattr(args, "json", None) or getattr(args, "plot", None))


def write_outputs(doc: Doc, args: argparse.Namespace) -> None:
    """A benchmark's document as JSON to ``args.json`` (``-``: stdout) and as a PNG plot to
    ``args.plot`` (each when given)."""
    harness.write_json(doc, args)  # a file, or stdout for "-"
    if getattr(args, "plot", None):
        plots.save(doc, args.plot)


def load(directory: Path) -> tuple[list[Result], list[tuple[Path, str]]]:
    """The results in ``directory`` (sorted by file name) and the JSON files that are not
    results, each with the reason."""
    results: list[Result] = []
    skipped: list[tuple[Path, str]] = []
    for path in sorted(directory.glob("*.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError) as e:
            skipped.append((path, f"not readable JSON: {e}"))
            continue
        if not isinstance(doc, dict) or not isinstance(doc.get("bench"), str):
            skipped.append((path, 'no "bench" key: not a benchmark result'))
            continue
        results.append(Result(path, doc))
    return results, skipped


# ---- formatting ----


def _md(text: Any) -> str:
    """A table cell: pipes escaped, no line breaks."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> list[str]:
    """A Markdown table; ``align`` has one letter per column (l or r, default r but the first)."""
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---:" if a == "r" else ":---" for a in align]
    out = ["| " + " | ".join(_md(h) for h in head) + " |", "| " + " | ".join(sep) + " |"]
    out += ["| " + " | ".join(_md(c) for c in r) + " |" for r in rows]
    return out


def _f(v: Any, digits: int = 1) -> str:
    try:
        return f"{float(v):,.{digits}f}"
    except (TypeError, ValueError):
        return "-"


def _reconstructed_command(doc: Doc) -> str:
    """A command that reproduces ``doc`` as far as it records its options."""
    argv = ["afabric", "bench", str(doc.get("bench"))]
    if doc.get("provider"):
        argv += ["--provider", str(doc["provider"])]
    if doc.get("bench") == "trigger" and doc.get("iterations"):
        argv += ["--iterations", str(doc["iterations"])]
    if doc.get("bench") == "overhead":
        peers = [str(r.get("peers")) for r in doc.get("results", []) if isinstance(r, Mapping)]
        if peers:
            argv += ["--peers", ",".join(peers)]
    if doc.get("bench") == "p2p":
        sizes = sorted({int(r["size"]) for r in doc.get("rows", []) if r.get("kind") == "write"})
        if sizes:
            argv += ["--sizes", ",".join(map(str, sizes))]
        if doc.get("sweep") == "full":
            argv.append("--full")
    for key in ("loop", "polling", "pattern"):
        if doc.get(key):
            argv += [f"--{key}", str(doc[key])]
    return shlex.join(argv)


def _header(r: Result, link: str) -> list[str]:
    d = r.doc
    prov = str(d.get("provider", "?"))
    if d.get("fabric_provider") and d["fabric_provider"] != prov:
        prov += f" (libfabric: {d['fabric_provider']})"
    machine = str(d.get("host") or "unknown host")
    if d.get("cpus"):
        machine += f", {d['cpus']} cores"
    settings = [f"{k} {d[k]}" for k in ("loop", "polling", "pattern") if d.get(k)]
    cmd = d.get("command")
    cmd_note = "" if cmd else " (reconstructed from the result)"
    return [
        f"## {r.bench}: {prov}, {d.get('host') or 'unknown host'}, {plots.fmt_date(d)}",
        "",
        f"- command: `{cmd or _reconstructed_command(d)}`{cmd_note}",
        f"- provider: {prov}" + (f"; {', '.join(settings)}" if settings else ""),
        f"- machine: {machine}",
        f"- date: {plots.fmt_date(d)}",
        f"- data: [{r.path.name}]({link})",
    ]


# ---- the key numbers of each kind ----


def _p2p(d: Doc) -> list[str]:
    rows = []
    fi = any(r.get("fi_gbps") for r in d.get("rows", []))  # --fabtests: fi_rma_bw beside each row
    dc = any(r.get("fi_dc_gbps") for r in d.get("rows", []))  # ...and its -U beside write rows
    bat = any(r.get("batch_gbps") for r in d.get("rows", []))  # write_many in fi_rma_bw's pattern
    for r in d.get("rows", []):
        size = plots.fmt_size(float(r["size"])) + ("/page" if r.get("kind") == "paged" else "")
        rows.append([
            r.get("kind", "?"), size, r.get("window", ""), _f(r.get("py_gbps"), 2), _f(r.get("raw_gbps"), 2),
            _f(r.get("ratio"), 2), _f(r.get("py_ops"), 0), _f(r.get("raw_ops"), 0),
        ])  # fmt: skip
        py = float(r.get("py_gbps") or 0)
        for key in [k for k, shown in (("fi_gbps", fi), ("fi_dc_gbps", dc)) if shown]:
            ref = r.get(key) or 0.0
            rows[-1] += [_f(ref, 2) if ref else "", _f(py / ref, 2) if ref else ""]
        if bat:
            batch, fi_ref = float(r.get("batch_gbps") or 0), float(r.get("fi_gbps") or 0)
            rows[-1] += [_f(batch, 2) if batch else ""]
            rows[-1] += [_f(batch / fi_ref, 2) if batch and fi_ref else ""] if fi else []
    out = _table(
        ["op", "size", "window", "Python GB/s", "raw GB/s", "Python/raw", "Python op/s", "raw op/s"]
        + (["fi_rma_bw GB/s", "Python/fi"] if fi else [])
        + (["fi_rma_bw -U GB/s", "Python/fi -U"] if dc else [])
        + (["batch GB/s"] + (["batch/fi"] if fi else []) if bat else []),
        rows,
        "llrrrrrr" + ("rr" if fi else "") + ("rr" if dc else "") + ("r" + ("r" if fi else "") if bat else ""),
    )
    out.append("")
    for x in d.get("latency", []):
        out.append(
            f"Awaited {plots.fmt_size(float(x['size']))} write, one at a time: p50 {_f(x.get('p50_us'))} µs, "
            f"p99 {_f(x.get('p99_us'))} µs (raw C loop: {plots.raw_latency(x)}; "
            f"{x.get('samples', '?')} samples)."
        )
    above = [r for r in d.get("rows", []) if isinstance(r.get("ratio"), int | float) and r["ratio"] > 1]
    if above:
        sizes = ", ".join(plots.fmt_size(float(r["size"])) for r in above)
        out.append(
            f"Python/raw above 1 ({sizes}): the raw loop is not a ceiling there; both are limited by the "
            "transport and the ratio is 1 give or take run-to-run noise (each repeat's time is in the "
            "JSON's `samples`)."
        )
    paged = [r for r in d.get("rows", []) if r.get("kind") == "paged"]
    if paged:
        out.append(
            f"Paged rows: size is per page, op/s counts pages, {paged[0].get('ops_per_call', '?')} pages "
            "per call. `raw` is the shim's C loop on the same submit path, no Python per operation."
        )
    if bat:
        out.append(
            "Batch: the Python API posting a window of writes and waiting for all of it, `write_many` "
            "of `window` writes per call and one call at a time"
            + (" (`fi_rma_bw`'s own loop)." if fi else ".")
        )
    if any(r.get("kind") == "many" for r in d.get("rows", [])):
        out.append(
            "Many rows: `write_many`, several writes per call (`ops_per_call`), `window` calls in "
            "flight; op/s counts writes; `raw` is the C loop of single writes of that size."
        )
    return out


def _trigger(d: Doc) -> list[str]:
    rows = []
    for name, m in d.get("modes", {}).items():
        rows.append([
            name, m.get("samples", ""), _f(m.get("p50_us")), _f(m.get("p90_us")), _f(m.get("p99_us")),
            _f(m.get("p999_us")), _f(m.get("max_us")), _f(m.get("mean_us")),
        ])  # fmt: skip
    out = _table(["mode", "samples", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "max µs", "mean µs"], rows)
    out.append("")
    ratio = d.get("ratio_python_over_triggered", {})
    if ratio:
        line = "python/triggered: " + ", ".join(f"{k} {_f(v, 2)}x" for k, v in ratio.items())
        goal = d.get("goal", {})
        if goal:
            line += (
                f" (goal: triggered p99 at least {goal.get('p99_ratio_at_least', '?')}x lower: "
                f"{'met' if goal.get('met') else 'NOT met'})"
            )
        out.append(line + ".")
    facts = []
    if d.get("latency"):
        facts.append(f"latency: {d['latency']}")
    if d.get("size"):
        facts.append(f"{d['size']} B per write")
    if d.get("iterations"):
        facts.append(f"{d['iterations']} iterations per mode in {d.get('rounds', '?')} alternating blocks")
    if d.get("target"):
        facts.append(str(d["target"]))
    if facts:
        out.append("")
        out.append("; ".join(facts) + ".")
    return out


def _overhead(d: Doc) -> list[str]:
    rows = []
    last = None
    for peers, stage, v in plots.overhead_rows(d):
        rows.append(
            [peers if peers != last else "", stage, _f(v["p50"], 2), _f(v["p99"], 2), _f(v["p99.9"], 2)]
        )
        last = peers
    out = _table(["peers", "stage", "p50 µs", "p99 µs", "p99.9 µs"], rows, "rlrrr")
    notes = []
    for r in d.get("results", []):
        if not isinstance(r, Mapping):
            continue
        bits = [f"{r.get('iterations', '?')} scatters of {r.get('work_requests', '?')} writes"]
        if r.get("check"):
            bits.append(str(r["check"]))
        notes.append(f"- {r.get('peers', '?')} peers: " + "; ".join(bits))
    if notes:
        out += ["", *notes]
    defs = d.get("stage_definitions")
    if isinstance(defs, Mapping) and defs:
        out += ["", "Stages: " + "; ".join(f"`{k}`: {v}" for k, v in defs.items()) + "."]
    return out


TABLES: dict[str, Callable[[Doc], list[str]]] = {"p2p": _p2p, "trigger": _trigger, "overhead": _overhead}


def headline(d: Doc) -> str:
    """One line for the summary table."""
    try:
        if d.get("bench") == "p2p":
            rows = d.get("rows", [])
            best = max(
                (r for r in rows if r.get("kind") == "write"), key=lambda r: r["py_gbps"], default=None
            )
            parts = []
            if best:
                parts.append(
                    f"Python peak {_f(best['py_gbps'], 2)} GB/s at {plots.fmt_size(float(best['size']))}"
                )
            for x in d.get("latency", [])[:1]:
                parts.append(f"{plots.fmt_size(float(x['size']))} write p50 {_f(x['p50_us'])} µs")
            return "; ".join(parts)
        if d.get("bench") == "trigger":
            m = d.get("modes", {})
            t, p = m.get("triggered", {}), m.get("python", {})
            ratio = d.get("ratio_python_over_triggered", {}).get("p99")
            return (
                f"p99 triggered {_f(t.get('p99_us'))} µs, python {_f(p.get('p99_us'))} µs ({_f(ratio, 2)}x)"
            )
        if d.get("bench") == "overhead":
            rows = plots.overhead_rows(d)
            stage = "app" if any(s == "app" for _, s, _ in rows) else "total"
            vals = [(p, v["p50"]) for p, s, v in rows if s == stage]
            return f"{stage} p50: " + ", ".join(f"{_f(v)} µs at {p}" for p, v in vals)
    except (KeyError, TypeError, ValueError):
        pass
    return ""


# ---- the page ----


def _rel(target: Path, out_dir: Path) -> str:
    return Path(os.path.relpath(target.resolve(), out_dir.resolve())).as_posix()


def section(r: Result, out_dir: Path, png: Path | None, plot_note: str = "") -> str:
    """One result's Markdown: header, key numbers, plot."""
    lines = _header(r, _rel(r.path, out_dir))
    lines.append("")
    table = TABLES.get(r.bench)
    lines += table(r.doc) if table else [f"(no table for benchmark results of kind {r.bench!r})"]
    lines.append("")
    if png is not None:
        lines.append(f"![{r.bench}: {r.path.stem}]({_rel(png, out_dir)})")
        lines.append("")
    elif plot_note:
        lines.append(f"_{plot_note}_")
        lines.append("")
    return "\n".join(lines)


def render(
    results: Sequence[Result],
    skipped: Sequence[tuple[Path, str]],
    out_dir: Path,
    pngs: Mapping[Path, Path],
    notes: Mapping[Path, str],
    source: str,
) -> str:
    """The whole page."""
    out = [
        "# afabric benchmark results",
        "",
        f"{len(results)} result{'s' if len(results) != 1 else ''} from `{source}`, "
        f"page written {time.strftime('%Y-%m-%d %H:%M')} by `afabric bench report`. "
        "Nothing here is asserted: each section is one run as its JSON recorded it.",
        "",
    ]
    out += _table(
        ["result", "benchmark", "provider", "machine", "date", "headline"],
        [
            [f"[{r.path.stem}]({_rel(r.path, out_dir)})", r.bench, r.doc.get("provider", "?"),
             r.doc.get("host", "?"), plots.fmt_date(r.doc), headline(r.doc)]
            for r in results
        ],
        "llllll",
    )  # fmt: skip
    out.append("")
    for r in results:
        out.append(section(r, out_dir, pngs.get(r.path), notes.get(r.path, "")))
    if skipped:
        out.append("## Not results")
        out.append("")
        out += [f"- {p.name}: {why}" for p, why in skipped]
        out.append("")
    return "\n".join(out)


def build(
    directory: Path,
    output: Path | None = None,
    draw: bool = True,
    loaded: tuple[list[Result], list[tuple[Path, str]]] | None = None,
) -> tuple[Path, str, list[str]]:
    """Read ``directory`` (unless ``loaded`` is what :func:`load` returned for it), draw the
    plots (unless ``draw`` is false or matplotlib is missing), write the page; returns its
    path, its text and warnings for the user."""
    results, skipped = loaded if loaded is not None else load(directory)
    output = output if output is not None else directory / "README.md"
    out_dir = output.parent
    pngs: dict[Path, Path] = {}
    notes: dict[Path, str] = {}
    warnings: list[str] = []
    can_draw = draw and plots.available()
    if draw and not can_draw:
        warnings.append(f"plots not drawn: matplotlib is not installed ({plots.INSTALL_HINT})")
    for r in results:
        if not can_draw:
            notes[r.path] = (
                f"Plot not drawn: matplotlib is not installed ({plots.INSTALL_HINT})." if draw else ""
            )
            continue
        if r.bench not in plots.PLOTTERS:
            continue
        png = r.path.with_suffix(".png")
        try:
            plots.save(r.doc, png)
        except (KeyError, TypeError, ValueError, OSError) as e:  # a damaged document: keep the rest
            warnings.append(f"{r.path.name}: no plot ({type(e).__name__}: {e})")
            notes[r.path] = f"Plot not drawn: {type(e).__name__}: {e}."
            continue
        pngs[r.path] = png
    text = render(results, skipped, out_dir, pngs, notes, str(directory))
    output.write_text(text)
    return output, text, warnings


HELP = "one Markdown page (tables and PNG plots) from the --json results in a directory"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", metavar="DIR", help="directory holding the *.json results of afabric bench ...")
    p.add_argument("-o", "--output", metavar="PATH", default=None,
                   help="where to write the page (default: DIR/README.md); plots go next to the JSON")
    p.add_argument("--no-plots", action="store_true", help="tables only, no PNG plots")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        print(f"afabric: error: {directory} is not a directory", file=sys.stderr)
        return 2
    output = Path(args.output) if getattr(args, "output", None) else None
    if output is not None and not output.parent.is_dir():
        print(f"afabric: error: {output.parent} is not a directory", file=sys.stderr)
        return 2
    results, skipped = load(directory)
    if not results:
        print(
            f'afabric: error: no benchmark results (*.json with a "bench" key) in {directory}',
            file=sys.stderr,
        )
        for p, why in skipped:
            print(f"  {p.name}: {why}", file=sys.stderr)
        return 1
    draw = not getattr(args, "no_plots", False)
    path, _, warnings = build(directory, output, draw=draw, loaded=(results, skipped))
    for w in warnings:
        print(f"afabric: warning: {w}", file=sys.stderr)
    print(
        f"{path}: {len(results)} result{'s' if len(results) != 1 else ''}"
        + (f", {len(skipped)} other JSON file{'s' if len(skipped) != 1 else ''} skipped" if skipped else "")
    )
    return 0
