"""PNG plots of benchmark results, drawn from the JSON documents the benchmarks write.

Every function here takes the document (the dict ``--json`` writes), never live objects, so
``afabric bench p2p --plot`` and ``afabric bench report`` draw the same figures:

- ``p2p``: bandwidth against message size (log x), Python API and raw C loop, contiguous
  writes and paged writes (by page size) in two panels;
- ``trigger``: latency CDFs of the triggered and the Python-loop modes (log x), with the tail
  (the fraction of writes at least that slow, log y) beside it;
- ``overhead``: p50 and p99 of each stage of an operation against the number of peers.

matplotlib is optional (``pip install 'afabric[plot]'``); without it :func:`require` and
:func:`save` raise :class:`PlotUnavailable` with that hint. Figures are rendered with the Agg
canvas directly, so no display and no pyplot state are involved.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "INSTALL_HINT",
    "PLOTTERS",
    "PlotUnavailable",
    "available",
    "figure",
    "fmt_size",
    "overhead_figure",
    "overhead_rows",
    "p2p_figure",
    "require",
    "save",
    "title",
    "trigger_figure",
]

INSTALL_HINT = "pip install 'afabric[plot]'"
Doc = Mapping[str, Any]

PY_COLOR, RAW_COLOR = "#1f77b4", "#d62728"
MODE_COLORS = {"triggered": "#2ca02c", "python": "#ff7f0e"}
STAGE_COLORS = ("#4c72b0", "#55a868", "#c44e52", "#8172b2", "#ccb974", "#64b5cd", "#8c8c8c")


class PlotUnavailable(RuntimeError):
    """Plotting was asked for and cannot be done here (matplotlib missing, unknown document)."""


def available() -> bool:
    """Whether matplotlib can be imported (and is: a broken install counts as missing)."""
    if importlib.util.find_spec("matplotlib") is None:
        return False
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raise :class:`PlotUnavailable` (with the install hint) when matplotlib is missing."""
    if not available():
        raise PlotUnavailable(f"plots need matplotlib, which is not installed: {INSTALL_HINT}")


# ---- labels ----


def raw_latency(x: dict[str, Any]) -> str:
    """The raw C loop's awaited-write latency of a result's ``latency`` entry: p50, p99 and
    mean; results written before the loop timed each write hold only the mean (under
    ``raw_p50_us``, without ``raw_mean_us``)."""
    if "raw_mean_us" not in x:
        return f"{float(x.get('raw_p50_us', 0.0)):.1f} µs mean"
    p50, p99, mean = (float(x[k]) for k in ("raw_p50_us", "raw_p99_us", "raw_mean_us"))
    return f"p50 {p50:.1f}, p99 {p99:.1f}, mean {mean:.1f} µs"


def fmt_size(n: float) -> str:
    """Bytes in binary units: ``8 B``, ``4 KiB``, ``1 MiB``, ``1.5 GiB``."""
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= f:
            return f"{n / f:g} {unit}"
    return f"{n:g} B"


def fmt_date(doc: Doc) -> str:
    """The document's ``date`` (``2026-11-30T03:45:39``) as ``2026-11-30 03:45``."""
    date = str(doc.get("date", "") or "")
    return date.replace("T", " ")[:16] if date else "date unknown"


def title(doc: Doc, what: str) -> str:
    """Two lines: the benchmark, the provider, loop and polling; then host, cores and date."""
    bench = doc.get("bench", "?")
    prov = str(doc.get("provider", "?"))
    fabric = doc.get("fabric_provider")
    if fabric and fabric != prov:
        prov += f" ({fabric})"
    parts = [f"provider {prov}"]
    if doc.get("loop"):
        parts.append(f"loop {doc['loop']}")
    if doc.get("polling"):
        parts.append(f"{doc['polling']} polling")
    host = [str(doc.get("host") or "unknown host")]
    if doc.get("cpus"):
        host.append(f"{doc['cpus']} cores")
    host.append(fmt_date(doc))
    return f"afabric bench {bench}: {what}\n{', '.join(parts)} — {', '.join(host)}"


def _size_axis(ax: Axes, sizes: Sequence[float]) -> None:
    ax.set_xscale("log", base=2)
    ticks = sorted(set(sizes))
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([fmt_size(s) for s in ticks], rotation=45, ha="right")
        ax.minorticks_off()
        lo, hi = ticks[0], ticks[-1]
        ax.set_xlim(lo / 1.5, hi * 1.5)


def _plain_log_x(ax: Axes) -> None:
    """Log x with ticks at 1, 2, 5 x 10^k written as plain numbers (5, 10, 20, 50 ...)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    ax.set_xscale("log")
    ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _new_figure(width: float, height: float) -> Figure:
    require()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _footnote(fig: Figure, text: str) -> None:
    """A line of small grey text under the axes (the layout leaves room for it)."""
    fig.text(0.01, 0.005, text, fontsize=9, ha="left", va="bottom", color="#444444")
    fig.set_layout_engine("constrained", rect=(0, 0.04, 1, 0.96))


# ---- p2p ----


def p2p_figure(doc: Doc) -> Figure:
    """Bandwidth (GB/s) against size; Python API and raw C loop; contiguous and paged panels."""
    rows: list[Mapping[str, Any]] = list(doc.get("rows", []))
    kinds = [k for k in ("write", "paged") if any(r.get("kind") == k for r in rows)]
    kinds += sorted({str(r.get("kind")) for r in rows} - set(kinds))
    fig = _new_figure(6.0 * max(1, len(kinds)) + 1.0, 5.6)
    fig.suptitle(title(doc, "bandwidth by message size"), fontsize=11)
    axes = fig.subplots(1, max(1, len(kinds)), squeeze=False)[0]
    for ax, kind in zip(axes, kinds, strict=False):
        sel = sorted((r for r in rows if r.get("kind") == kind), key=lambda r: float(r["size"]))
        sizes = [float(r["size"]) for r in sel]
        ax.plot(sizes, [r["py_gbps"] for r in sel], "o-", color=PY_COLOR, lw=2, label="Python API")
        ax.plot(sizes, [r["raw_gbps"] for r in sel], "s--", color=RAW_COLOR, lw=2, label="raw C loop")
        _size_axis(ax, sizes)
        if kind == "write":
            ax.set_title("contiguous writes")
            ax.set_xlabel("message size (bytes per write)")
        elif kind == "paged":
            per = sorted({int(r.get("ops_per_call", 0)) for r in sel})
            ax.set_title(f"paged writes ({'/'.join(map(str, per))} pages per call)")
            ax.set_xlabel("page size (bytes per page)")
        else:
            ax.set_title(kind)
            ax.set_xlabel("size (bytes)")
        ax.set_ylabel("bandwidth (GB/s, 10⁹ bytes/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(loc="upper left")
    if not kinds:
        axes[0].text(
            0.5, 0.5, "no rows in this result", ha="center", va="center", transform=axes[0].transAxes
        )
    notes = [
        f"awaited {fmt_size(x['size'])} write, one at a time: p50 {x['p50_us']:.1f} µs, "
        f"p99 {x['p99_us']:.1f} µs (raw C loop {raw_latency(x)}, {x['samples']} samples)"
        for x in doc.get("latency", [])
    ]
    if notes:
        _footnote(fig, "; ".join(notes))
    return fig


# ---- trigger ----


def _mode_samples_us(m: Mapping[str, Any]) -> list[float]:
    """Per-iteration latencies in µs, sorted; from ``samples_ns`` or, when a document lacks
    them, the stored percentiles (a coarse staircase)."""
    ns = m.get("samples_ns")
    if ns:
        return sorted(v / 1e3 for v in ns)
    pcts: Mapping[str, float] = m.get("percentiles_us", {})
    return sorted(float(v) for v in pcts.values())


def trigger_figure(doc: Doc) -> Figure:
    """Latency CDFs (log x) of each mode, and their tails (log-log)."""
    modes: Mapping[str, Mapping[str, Any]] = doc.get("modes", {})
    fig = _new_figure(13.0, 5.4)
    ratio = doc.get("ratio_python_over_triggered", {})
    what = "watcher change → first post of the write it releases"
    fig.suptitle(title(doc, what), fontsize=11)
    cdf_ax, tail_ax = fig.subplots(1, 2)
    floor = math.inf
    for name, m in modes.items():
        xs = [v for v in _mode_samples_us(m) if v > 0]
        if not xs:
            continue
        floor = min(floor, xs[0])
        n = len(xs)
        color = MODE_COLORS.get(name)
        label = (
            f"{name}: p50 {m.get('p50_us', 0.0):.1f} µs, p99 {m.get('p99_us', 0.0):.1f} µs, "
            f"p99.9 {m.get('p999_us', 0.0):.1f} µs ({m.get('samples', n)} samples)"
        )
        cdf_ax.step(xs, [(i + 1) / n for i in range(n)], where="post", color=color, lw=2, label=label)
        tail_ax.step(xs, [(n - i) / n for i in range(n)], where="post", color=color, lw=2, label=name)
    for q, style in ((0.5, ":"), (0.99, "--")):
        cdf_ax.axhline(q, color="#888888", lw=0.8, ls=style)
        tail_ax.axhline(1 - q, color="#888888", lw=0.8, ls=style)
    _plain_log_x(cdf_ax)
    cdf_ax.set_ylim(0, 1.02)
    cdf_ax.set_xlabel("latency (µs, log scale)")
    cdf_ax.set_ylabel("fraction of writes at most this latency")
    cdf_ax.set_title("CDF (dotted: p50, dashed: p99)")
    cdf_ax.legend(loc="lower right", fontsize=8)
    _plain_log_x(tail_ax)
    tail_ax.set_yscale("log")
    tail_ax.set_xlabel("latency (µs, log scale)")
    tail_ax.set_ylabel("fraction of writes at least this latency")
    tail_ax.set_title("tail (1 - CDF, log scale)")
    tail_ax.legend(loc="lower left", fontsize=9)
    for ax in (cdf_ax, tail_ax):
        ax.grid(True, which="both", alpha=0.25)
        if math.isfinite(floor):
            ax.set_xlim(left=floor / 1.3)
    if ratio:
        goal = doc.get("goal", {})
        text = "python/triggered: " + ", ".join(f"{k} {float(v):.2f}x" for k, v in ratio.items())
        if goal:
            met = "met" if goal.get("met") else "NOT met"
            text += f"  (goal: p99 ratio ≥ {goal.get('p99_ratio_at_least', '?')}: {met})"
        _footnote(fig, text)
    return fig


# ---- overhead ----


def _num(v: Any) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def _stat(d: Mapping[str, Any], q: str) -> float:
    """``d``'s value for percentile ``q`` ("p50", "p99", "p99.9"), whichever spelling it uses."""
    alts = {
        "p50": ("p50_us", "p50"),
        "p99": ("p99_us", "p99"),
        "p99.9": ("p999_us", "p99.9_us", "p99.9", "p999"),
    }
    for k in alts[q]:
        if k in d:
            return _num(d[k])
    return math.nan


def overhead_rows(doc: Doc) -> list[tuple[int, str, dict[str, float]]]:
    """``(peers, stage, {"p50": µs, "p99": µs, "p99.9": µs})`` for every peer count and stage
    of an ``overhead`` document, in the document's order."""
    out: list[tuple[int, str, dict[str, float]]] = []
    entries: Any = doc.get("results", doc.get("rows", doc.get("peers", [])))
    if isinstance(entries, Mapping):  # {"1": {...}, "4": {...}}
        entries = [dict(v, peers=int(k)) if isinstance(v, Mapping) else v for k, v in entries.items()]
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, Mapping):
            continue
        peers = int(_num(e.get("peers", e.get("peer_count", e.get("n_peers", 0)))))
        stages = e.get("stages", {})
        if isinstance(stages, Mapping):
            items = list(stages.items())
        else:
            items = [(str(s.get("stage", s.get("name", "?"))), s) for s in stages if isinstance(s, Mapping)]
        for stage, st in items:
            if isinstance(st, Mapping):
                out.append((peers, str(stage), {q: _stat(st, q) for q in ("p50", "p99", "p99.9")}))
    order = [str(s) for s in doc.get("stages", []) if isinstance(s, str)]  # the document's stage order
    if order:
        rank = {s: i for i, s in enumerate(order)}
        where = {p: i for i, p in enumerate(dict.fromkeys(p for p, _, _ in out))}
        out.sort(key=lambda r: (where[r[0]], rank.get(r[1], len(rank))))  # stable for unlisted stages
    return out


OVERHEAD_TOTALS = ("total", "app")  # stages that are sums of others: drawn as markers, not bars
_TOTAL_MARKERS = {"total": ("_", "shim total (enqueue → completion)"), "app": ("D", "app (await scatter)")}


def overhead_figure(doc: Doc) -> Figure:
    """For each peer count, the stages' percentiles stacked (p50 and p99 panels), with the
    measured percentiles of the whole (``total``, ``app``) as markers on top."""
    rows = overhead_rows(doc)
    peers = sorted({p for p, _, _ in rows})
    stages: list[str] = []
    for _, s, _ in rows:
        if s not in stages:
            stages.append(s)
    parts = [s for s in stages if s not in OVERHEAD_TOTALS]
    totals = [s for s in stages if s in OVERHEAD_TOTALS]
    value = {(p, s): v for p, s, v in rows}
    size = doc.get("size")
    what = "where a scatter's time goes, by number of peers"
    if size:
        what += f" ({fmt_size(float(size))} per peer)"
    fig = _new_figure(13.0, 5.8)
    fig.suptitle(title(doc, what), fontsize=11)
    axes = fig.subplots(1, 2)
    xs = list(range(len(peers)))
    for ax, q in zip(axes, ("p50", "p99"), strict=True):
        bottom = [0.0] * len(peers)
        for j, stage in enumerate(parts):
            ys = [value.get((p, stage), {}).get(q, math.nan) for p in peers]
            ys = [max(0.0, y) if math.isfinite(y) else 0.0 for y in ys]
            ax.bar(
                xs,
                ys,
                0.6,
                bottom=bottom,
                label=stage.replace("_", " "),
                color=STAGE_COLORS[j % len(STAGE_COLORS)],
                edgecolor="white",
                linewidth=0.5,
            )
            bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        for stage in totals:
            marker, label = _TOTAL_MARKERS.get(stage, ("o", stage))
            ys = [value.get((p, stage), {}).get(q, math.nan) for p in peers]
            ax.plot(
                xs,
                ys,
                ls="none",
                marker=marker,
                ms=14 if marker == "_" else 7,
                mew=2.5,
                color="black" if stage == "total" else "#444444",
                label=f"{label}, measured {q}",
            )
        ax.set_xticks(xs)
        ax.set_xticklabels([str(p) for p in peers])
        ax.set_xlabel("peers (targets per scatter)")
        ax.set_ylabel(f"{q} time (µs)")
        ax.set_title(f"{q}: each stage's {q}, stacked")
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        ax.set_axisbelow(True)
        if not rows:
            ax.text(0.5, 0.5, "no stages in this result", ha="center", va="center", transform=ax.transAxes)
    if stages:
        handles, labels = axes[0].get_legend_handles_labels()
        n = len(parts)  # bars first (bottom of the stack first), then the markers: list the top first
        order = list(range(n, len(handles))) + list(range(n - 1, -1, -1))
        axes[0].legend([handles[i] for i in order], [labels[i] for i in order], loc="upper left", fontsize=8)
    _footnote(
        fig,
        "Percentiles of the stages do not add up to the percentile of the whole: "
        "the markers are the measured ones.",
    )
    return fig


# ---- dispatch ----

PLOTTERS = {"p2p": p2p_figure, "trigger": trigger_figure, "overhead": overhead_figure}


def figure(doc: Doc) -> Figure:
    """The figure for any benchmark document (by its ``bench`` key)."""
    bench = doc.get("bench")
    fn = PLOTTERS.get(str(bench))
    if fn is None:
        raise PlotUnavailable(f"no plot for benchmark results of kind {bench!r}")
    return fn(doc)


def save(doc: Doc, path: str | Path) -> Path:
    """Draw ``doc`` and write it as a PNG to ``path``; returns the path."""
    fig = figure(doc)
    out = Path(path)
    fig.savefig(out, format="png", dpi=100)
    return out
