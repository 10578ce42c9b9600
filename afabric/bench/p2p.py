"""`afabric bench p2p`: bandwidth and operation rate between two processes on this machine.

By default a quick sweep (a few sizes, fewer operations, 3 repeats: a table within about a
minute on a 2-core machine); ``--full`` runs every size at fi_rma_bw's own operation counts
and 5 repeats (7-8 minutes there). Progress goes to stderr at least every
:data:`~afabric.bench.progress.HEARTBEAT_S` seconds, with an ETA.

A target process registers memory and publishes its descriptor; this process writes to it
through the Python API (W coroutines each awaiting its writes, the idiomatic way to keep W
in flight) and through the shim's raw C loop (same submit path, no Python per operation);
each write row also through write_many in fi_rma_bw's own loop (a window per call, one call
at a time: the batch column).
Every number is the median of repeated runs; the ratio column is Python over raw from
the same run. Nothing here asserts speed: it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from .. import Engine, MemoryRegion, MrDesc, Pages, host_buffer
from . import fabtests, harness, report
from .loops import run as run_on_loop
from .progress import HEARTBEAT_S, Progress
from .raw import RawLoop, shim_path

KiB, MiB = 1 << 10, 1 << 20
CONTIG_SIZES = [8, 64, 512, 4 * KiB, 32 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB]
QUICK_CONTIG = [8, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]
PAGE_SIZES = [1 * KiB, 4 * KiB, 16 * KiB, 64 * KiB]
QUICK_PAGES = [1 * KiB, 32 * KiB]
READ_SIZES = [8, 4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB]  # read rows (one-sided READ, remote -> local)
QUICK_READ = [4 * KiB, 1 * MiB]
REGION = 128 * MiB
# The ETA's cost model (seconds; the pace of the finished rows rescales it): an operation
# costs about OP_S plus its bytes at BYTES_PER_S (2-core machine, shm, quick sweep).
OP_S = 10e-6
BYTES_PER_S = 4e9
PAGES_PER_OP = 64
MANY_SIZE = 4 * KiB  # write_many row: writes of this size, WRITES_PER_CALL per call
WRITES_PER_CALL = 64
MANY_WINDOW = 4  # calls in flight (4 x 64 writes; the raw loop keeps 64 single writes)
# --pattern: where the contiguous, read and write_many rows put their operations
PATTERNS = {
    "span": f"each operation its own slot of its size, rotating through {REGION // MiB} MiB "
    "(memory-bound, as a KV cache's pages are)",
    "fixed": "every operation from and to offset 0 of one buffer of its size (cache-resident: "
    "fi_rma_bw's pattern)",
}


@dataclass
class Row:
    kind: str  # "write", "read", "paged" or "many" (write_many; raw: the C loop of single writes)
    size: int  # bytes per write, or bytes per page
    ops_per_call: int  # 1, or pages per paged write
    window: int
    py_gbps: float = 0.0
    raw_gbps: float = 0.0
    py_ops: float = 0.0  # writes (or pages) per second
    raw_ops: float = 0.0
    fi_gbps: float = 0.0  # fi_rma_bw at the same size and window (--fabtests), else 0
    # fi_rma_bw -U (delivery complete, as afabric's writes complete) beside write rows, else 0
    fi_dc_gbps: float = 0.0
    # write rows: write_many of `window` writes per call, one call at a time (fi_rma_bw's own
    # loop: post a window, wait for all of it), else 0
    batch_gbps: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        return self.py_gbps / self.raw_gbps if self.raw_gbps else 0.0


@dataclass
class Latency:
    size: int
    p50_us: float
    p99_us: float
    raw_p50_us: float  # the raw C loop's writes one at a time (RawLoop.latency)
    raw_p99_us: float
    raw_mean_us: float
    samples: int
    fi_pingpong_us: float = 0.0  # fi_rdm_pingpong half round trip (--fabtests), else 0


def _target(conn: Connection, provider: str, polling: str, loop: str, hugepages: bool) -> None:
    async def run() -> None:
        async with Engine(provider, polling=polling) as eng:
            buf = host_buffer(REGION) if hugepages else np.zeros(REGION, dtype=np.uint8)
            mr = eng.register(buf, remote="rw")  # written to, and read from by the read rows
            conn.send(bytes(mr.descriptor))
            aloop = asyncio.get_running_loop()
            await aloop.run_in_executor(None, conn.recv)

    run_on_loop(run(), loop)




def _iters_for(nbytes: int, quick: bool) -> int:
    budget = (64 if quick else 256) * MiB
    return int(max(64, min(20000 if quick else 50000, budget // max(nbytes, 1))))


def _window_for(nbytes: int) -> int:
    # fi_rma_bw's windows (64, and 16 from 1 MiB on), so that --fabtests compares like with like
    return 64 if nbytes < 1 * MiB else 16


class _Slots:
    """Where a row's operations go (--pattern): ``span`` rotates through the whole source
    region; ``fixed`` registers a buffer of the row's size, so that the raw loop (which
    rotates through what both regions hold) and the Python lanes both stay at offset 0."""

    def __init__(self, eng: Engine, src: np.ndarray, mr: MemoryRegion, pattern: str) -> None:
        self._eng, self._src, self._mr, self._fixed = eng, src, mr, pattern == "fixed"
        self._own: dict[int, MemoryRegion] = {}

    def region(self, size: int) -> MemoryRegion:
        if not self._fixed:
            return self._mr
        if size not in self._own:
            self._own[size] = self._eng.register(self._src[: max(size, 1)])
        return self._own[size]

    def span(self, size: int) -> int:
        return 1 if self._fixed else max(1, REGION // max(size, 1))

    def close(self) -> None:
        for mr in self._own.values():
            self._eng.deregister(mr)
        self._own.clear()


async def _py_writes(
    eng: Engine, mr: MemoryRegion, desc: MrDesc, nbytes: int, window: int, iters: int, *,
    read: bool = False, span: int | None = None,
) -> float:
    """Seconds per write (per read with ``read``), ``window`` Python lanes in flight, rotating
    through ``span`` slots of ``nbytes`` (default: the whole region)."""
    per = max(1, iters // window)
    if span is None:
        span = max(1, REGION // max(nbytes, 1))

    async def one(off: int) -> None:
        if read:
            await eng.read(mr, desc, nbytes, src_offset=off, dst_offset=off)
        else:
            await eng.write(mr, desc, nbytes, src_offset=off, dst_offset=off)

    async def lane(k: int) -> None:
        for i in range(per):
            await one(((k * per + i) % span) * nbytes)

    await asyncio.gather(*(one((k % span) * nbytes) for k in range(fabtests.RMA_WARMUP)))
    t0 = time.perf_counter()
    await asyncio.gather(*(lane(k) for k in range(window)))
    return (time.perf_counter() - t0) / (per * window)


async def _py_batches(
    eng: Engine, mr: MemoryRegion, desc: MrDesc, nbytes: int, window: int, iters: int, span: int
) -> float:
    """Seconds per write, ``window`` writes per write_many call and one call at a time:
    fi_rma_bw's loop (it posts a window, then waits for all of it) through the API, rotating
    through ``span`` slots of ``nbytes`` as _py_writes does."""
    calls = max(1, iters // window)
    ids = np.arange(calls * window, dtype=np.uint64).reshape(calls, window)
    offs = list((ids % np.uint64(span)) * np.uint64(nbytes))
    await eng.write_many(mr, desc, nbytes, offs[0], offs[0])  # warm-up: one window
    t0 = time.perf_counter()
    for off in offs:
        await eng.write_many(mr, desc, nbytes, off, off)
    return (time.perf_counter() - t0) / (calls * window)


def step_costs(args: argparse.Namespace, sizes: list[int], pages: list[int]) -> list[float]:
    """Each progress step's estimated seconds, in _measure's order (write rows, the
    write_many row, read rows, paged rows, latency): for the ETA only."""

    def ops(n: int, nbytes: int) -> float:
        return n * (OP_S + nbytes / BYTES_PER_S)

    r = args.repeat
    out = [r * 3 * ops(fabtests.rma_iters(s, args.quick), s) for s in sizes]  # py, batch, raw
    out.append(r * 2 * ops(_iters_for(MANY_SIZE, args.quick), MANY_SIZE))
    out += [r * 2 * ops(fabtests.rma_iters(s, args.quick), s) for s in _read_sizes(args)]
    for page in pages:
        iters = max(16, _iters_for(page * PAGES_PER_OP, args.quick))
        out.append(r * 2 * ops(iters * PAGES_PER_OP, page))
    n = 2000 if args.quick else 20000
    out.append(ops(2 * n + 200, 8) * 2)  # awaited one at a time: a round trip each
    return out


def _read_sizes(args: argparse.Namespace) -> list[int]:
    """Read rows: the contiguous sizes asked for (--sizes), else their own list."""
    return list(args.sizes or (QUICK_READ if args.quick else READ_SIZES))


async def _contig_rows(
    args: argparse.Namespace, eng: Engine, slots: _Slots, desc: MrDesc, sizes: list[int], bar: Progress,
    *, read: bool = False,
) -> list[Row]:
    """Contiguous writes (reads of the target's region into ours with ``read``): Python,
    the raw C loop and fi_rma_bw (-o writedata / -o read), alternately; write rows also
    Python in fi_rma_bw's own pattern (_py_batches)."""
    kind = "read" if read else "write"
    rows: list[Row] = []
    for size in sizes:
        bar.step(f"{kind} {_fmt_size(size)}")
        # fi_rma_bw's window, operations and warm-up, so that the rows compare like with like
        window, iters = _window_for(size), fabtests.rma_iters(size, args.quick)
        mr, span = slots.region(size), slots.span(size)
        raw_loop = RawLoop(eng, mr, desc)
        row = Row(kind, size, 1, window)
        py: list[float] = []
        raw: list[float] = []
        fi: list[float] = []
        fi_dc: list[float] = []
        batch: list[float] = []
        for _ in range(args.repeat):  # alternately: the C library, then afabric
            fi += await _rma_bw(args, size, window, "read" if read else "writedata")
            if not read:
                fi_dc += await _rma_bw(args, size, window, "writedata", delivery_complete=True)
            py.append(await _py_writes(eng, mr, desc, size, window, iters, read=read, span=span))
            if not read:
                batch.append(await _py_batches(eng, mr, desc, size, window, iters, span))
            run = raw_loop.read if read else raw_loop.write
            run(size, window, fabtests.RMA_WARMUP)
            raw_ns = run(size, window, iters)
            raw.append(_raw(raw_ns, iters))
        _fill(row, py, raw, size)
        row.fi_gbps = statistics.median(fi) if fi else 0.0
        row.fi_dc_gbps = statistics.median(fi_dc) if fi_dc else 0.0
        row.batch_gbps = size / statistics.median(batch) / 1e9 if batch else 0.0
        if batch:
            row.samples["batch_s_per_write"] = batch
        rows.append(row)
        bar.advance()
    return rows


async def _py_many(
    eng: Engine, mr: MemoryRegion, desc: MrDesc, nbytes: int, window: int, iters: int, span: int
) -> float:
    """Seconds per write_many call of WRITES_PER_CALL writes, ``window`` calls in flight."""
    calls = max(1, iters // (window * WRITES_PER_CALL))
    first = np.arange(window * calls) * WRITES_PER_CALL
    offs = [
        [(first[k * calls + i] + np.arange(WRITES_PER_CALL)) % span * nbytes for i in range(calls)]
        for k in range(window)
    ]

    async def lane(k: int) -> None:
        for off in offs[k]:
            await eng.write_many(mr, desc, nbytes, off, off)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane(k) for k in range(window)))
    return (time.perf_counter() - t0) / (calls * window)  # per call


async def _py_paged(
    eng: Engine, mr: MemoryRegion, desc: MrDesc, page: int, src: Pages, dst: Pages, window: int, iters: int
) -> float:
    per = max(1, iters // window)

    async def lane() -> None:
        for _ in range(per):
            await eng.write_paged(mr, desc, page_len=page, src_pages=src, dst_pages=dst)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(window)))
    return (time.perf_counter() - t0) / (per * window)


async def _many_row(
    args: argparse.Namespace, eng: Engine, slots: _Slots, desc: MrDesc, bar: Progress
) -> Row:
    """write_many of MANY_SIZE writes and the raw C loop of single writes, alternately."""
    bar.step(f"write_many {_fmt_size(MANY_SIZE)}")
    mr = slots.region(MANY_SIZE)
    raw_loop = RawLoop(eng, mr, desc)
    window, iters = _window_for(MANY_SIZE), _iters_for(MANY_SIZE, args.quick)
    row = Row("many", MANY_SIZE, WRITES_PER_CALL, MANY_WINDOW)
    py, raw = [], []
    for _ in range(args.repeat):
        py.append(await _py_many(eng, mr, desc, MANY_SIZE, MANY_WINDOW, iters, slots.span(MANY_SIZE)))
        # per WRITES_PER_CALL single writes, so that the rows compare per write
        raw.append(_raw(raw_loop.write(MANY_SIZE, window, iters), iters) * WRITES_PER_CALL)
    _fill(row, py, raw, MANY_SIZE * WRITES_PER_CALL, per_call=WRITES_PER_CALL)
    bar.advance()
    return row


def _route_fabric(fabric: str, route: str) -> str:
    """The library's provider of a routed engine's transport `route`: "tcp;ofi_rxm" of
    "cma;process_vm_writev+tcp;ofi_rxm" for "tcp"."""
    return next((p for p in fabric.split("+") if p.split(";", 1)[0] == route), "")


def _raw(elapsed_ns: int, count: int) -> float:
    """Seconds per operation from a raw C loop's elapsed nanoseconds."""
    return elapsed_ns / 1e9 / count


async def _measure(args: argparse.Namespace, desc_blob: bytes) -> tuple[list[Row], list[Latency], Engine]:
    eng = Engine(args.provider, polling=args.polling)
    sizes = args.sizes or (QUICK_CONTIG if args.quick else CONTIG_SIZES)
    pages = QUICK_PAGES if args.quick else PAGE_SIZES
    # on stderr: a bar on a terminal, else lines; shown at least every HEARTBEAT_S, with an ETA
    bar = Progress(len(sizes) + len(_read_sizes(args)) + len(pages) + 2,
                   weights=step_costs(args, sizes, pages), heartbeat=HEARTBEAT_S)  # fmt: skip
    try:
        desc = MrDesc.from_bytes(desc_blob)
        src = np.random.default_rng(0).integers(0, 256, REGION, dtype=np.uint8)
        if args.hugepages:
            src = _copied(host_buffer(REGION), src)
        mr = eng.register(src)
        raw_loop = RawLoop(eng, mr, desc)  # paged rows: the raw loop drives the same imported descriptor
        slots = _Slots(eng, src, mr, args.pattern)
        rows = await _contig_rows(args, eng, slots, desc, sizes, bar)
        rows.append(await _many_row(args, eng, slots, desc, bar))
        rows += await _contig_rows(args, eng, slots, desc, _read_sizes(args), bar, read=True)
        slots.close()
        rng = np.random.default_rng(1)
        for page in pages:
            bar.step(f"paged {_fmt_size(page)}/pg")
            npages = REGION // page
            count = PAGES_PER_OP
            window = 16
            iters = max(16, _iters_for(page * count, args.quick))
            s_idx = rng.choice(npages, count, replace=False).astype(np.int64)
            d_idx = rng.choice(npages, count, replace=False).astype(np.int64)
            sp, dp = Pages(s_idx, page), Pages(d_idx, page)
            row = Row("paged", page, count, window)
            py, raw = [], []
            for _ in range(args.repeat):
                py.append(await _py_paged(eng, mr, desc, page, sp, dp, window, iters))
                raw.append(_raw(raw_loop.paged(page, s_idx, d_idx, window, iters), iters))
            _fill(row, py, raw, page * count, per_call=count)
            rows.append(row)
            bar.advance()
        bar.step("latency 8 B")
        lat = [await _latency(eng, mr, desc, 8, args.quick)]
        lat[0].fi_pingpong_us = await _pingpong(args)
        bar.close()
        return rows, lat, eng
    except BaseException:
        bar.close()
        await eng.aclose()
        raise


async def _latency(eng: Engine, mr: MemoryRegion, desc: MrDesc, size: int, quick: bool) -> Latency:
    n = 2000 if quick else 20000
    for _ in range(200):
        await eng.write(mr, desc, size)
    samples = []
    clock = time.perf_counter_ns
    for _ in range(n):
        t0 = clock()
        await eng.write(mr, desc, size)
        samples.append(clock() - t0)
    samples.sort()
    raw = np.sort(RawLoop(eng, mr, desc).latency(size, n))
    p50, p99 = samples[len(samples) // 2], samples[int(len(samples) * 0.99)]
    r50, r99 = int(raw[len(raw) // 2]), int(raw[int(len(raw) * 0.99)])
    return Latency(size, p50 / 1e3, p99 / 1e3, r50 / 1e3, r99 / 1e3, float(raw.mean()) / 1e3, n)


async def _off_loop(fn: Callable[..., float], *a: object) -> float:
    """A fabtests pair, run off the event loop (the engine's completions keep flowing)."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *a)


async def _rma_bw(
    args: argparse.Namespace, size: int, window: int, op: str = "writedata", delivery_complete: bool = False
) -> list[float]:
    """One fi_rma_bw sample (-o op; -U with ``delivery_complete``) at this size and window
    with --fabtests, else none."""
    if not args.fabtests:
        return []
    iters = fabtests.rma_iters(size, args.quick)
    return [await _off_loop(fabtests.rma_bw, args.fabtests, args.fabric, size, window, iters, op,
                            delivery_complete)]  # fmt: skip


async def _pingpong(args: argparse.Namespace) -> float:
    if not args.fabtests:
        return 0.0
    return await _off_loop(fabtests.pingpong_us, args.fabtests, args.fabric, 8, 2000 if args.quick else 20000)


def _fill(row: Row, py: list[float], raw: list[float], nbytes: int, per_call: int = 1) -> None:
    py_s, raw_s = statistics.median(py), statistics.median(raw)
    row.py_gbps = nbytes / py_s / 1e9
    row.raw_gbps = nbytes / raw_s / 1e9
    row.py_ops = per_call / py_s
    row.raw_ops = per_call / raw_s
    row.samples = {"py_s_per_call": py, "raw_s_per_call": raw}


def _fmt_size(n: int) -> str:
    for unit, f in (("MiB", MiB), ("KiB", KiB)):
        if n >= f and n % f == 0:
            return f"{n // f} {unit}"
    return f"{n} B"


def render(rows: list[Row], lat: list[Latency], header: str) -> str:
    out = [header, ""]
    fi = any(r.fi_gbps for r in rows)
    dc = any(r.fi_dc_gbps for r in rows)
    bat = any(r.batch_gbps for r in rows)
    out.append(
        f"{'op':<6} {'size':>8} {'win':>4} {'py GB/s':>9} {'raw GB/s':>9} {'py/raw':>7} "
        f"{'py op/s':>11} {'raw op/s':>11}" + (f" {'fi_rma_bw':>9} {'py/fi':>6}" if fi else "")
        + (f" {'fi -U':>7} {'py/-U':>6}" if dc else "")
        + (f" {'batch':>7}" + (f" {'bat/fi':>6}" if fi else "") if bat else "")
    )
    for r in rows:
        size = _fmt_size(r.size) + ("/pg" if r.kind == "paged" else "")
        out.append(
            f"{r.kind:<6} {size:>8} {r.window:>4} {r.py_gbps:>9.2f} {r.raw_gbps:>9.2f} {r.ratio:>7.2f} "
            f"{r.py_ops:>11,.0f} {r.raw_ops:>11,.0f}"
            + (f" {r.fi_gbps:>9.2f} {r.py_gbps / r.fi_gbps:>6.2f}" if r.fi_gbps else "")
            + (f" {r.fi_dc_gbps:>7.2f} {r.py_gbps / r.fi_dc_gbps:>6.2f}" if r.fi_dc_gbps else "")
            + _batch_cells(r, fi)
        )
    for x in lat:
        out.append(
            f"\nawaited {x.size} B write, one at a time: p50 {x.p50_us:.1f} µs, p99 {x.p99_us:.1f} µs "
            f"(raw C loop: p50 {x.raw_p50_us:.1f}, p99 {x.raw_p99_us:.1f}, mean {x.raw_mean_us:.1f} µs; "
            f"{x.samples} samples)"
            + (f"; fi_rdm_pingpong {x.fi_pingpong_us:.2f} µs (half round trip)" if x.fi_pingpong_us else "")
        )
    if fi:
        out.append("fi_rma_bw: libfabric's own C loop (-o writedata; -o read for read rows), same provider, "
                   "size and window, run alternately with afabric's rows; py/fi is the API's share of it")
        out.append("  fi_rma_bw rewrites one cache-resident buffer: like with like under --pattern fixed "
                   "(the default with --fabtests; the header names this run's pattern)")
    if dc:
        out.append("fi -U: fi_rma_bw -U, each write done once the target has it (delivery complete): the "
                   "completion afabric's writes ask for; plain fi_rma_bw's are done once sent")
    if bat:
        out.append(
            "batch: the Python API posting a window of writes and waiting for all of it, write_many of "
            "win writes per call and one call at a time"
            + ("; that is fi_rma_bw's own loop, and bat/fi is the batch's share of it" if fi else "")
        )
    out.append(f"paged rows: size is per page, op/s counts pages, {PAGES_PER_OP} pages per call")
    if any(r.kind == "read" for r in rows):
        out.append("read rows: one-sided READs of the target's region into ours (remote -> local)")
    if any(r.kind == "many" for r in rows):
        out.append(
            f"many rows: write_many, {WRITES_PER_CALL} writes per call, win calls in flight; op/s counts "
            "writes; raw is the C loop of single writes (window 64) of that size"
        )
    out += py_raw_note(rows)
    return "\n".join(out)


def _batch_cells(r: Row, fi: bool) -> str:
    """render()'s batch columns of one row: none for a row without a batch (read, paged and
    many rows: only write rows have one, and the columns are the last)."""
    if not r.batch_gbps:
        return ""
    ratio = f" {r.batch_gbps / r.fi_gbps:>6.2f}" if fi and r.fi_gbps else ""
    return f" {r.batch_gbps:>7.2f}{ratio}"


def py_raw_note(rows: list[Row]) -> list[str]:
    """Lines explaining the ``py/raw`` column, and each row where Python beat the raw loop
    with the spread of its repeats (min-max GB/s), so the reader can see it is within noise."""
    out = [
        "py/raw: the Python API's rate over the raw C loop's (same run, same submit path); below 1 is\n"
        "  what Python costs per operation."
    ]
    above = [r for r in rows if r.ratio > 1.0]
    if not above:
        return out
    out.append(
        "  Above 1 the raw loop is not a ceiling: both loops are then limited by the transport, not by\n"
        "  the code submitting, so the ratio is 1 give or take run-to-run noise (the raw loop is one C\n"
        "  thread that sleeps until writes complete, then refills the window: for writes of 64 KiB and\n"
        "  more after each completion; Python's lanes resume in batches from one drain of the\n"
        "  completion ring). Spread of the repeats where py/raw > 1, GB/s:"
    )
    for r in above:
        py = [r.size * r.ops_per_call / t / 1e9 for t in r.samples.get("py_s_per_call", []) if t > 0]
        raw = [r.size * r.ops_per_call / t / 1e9 for t in r.samples.get("raw_s_per_call", []) if t > 0]
        if py and raw:
            size = _fmt_size(r.size) + ("/pg" if r.kind == "paged" else "")
            out.append(
                f"  {r.kind} {size}: py {min(py):.2f}-{max(py):.2f}, raw {min(raw):.2f}-{max(raw):.2f} "
                f"({len(py)} repeats)"
            )
    return out


HELP = "point-to-point write/send bandwidth and latency between two processes"


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_run_arguments(p, "the default: a few sizes, fewer operations, 3 repeats")
    p.add_argument("--full", action="store_true",
                   help="every size (writes 8 B-64 MiB, reads 8 B-16 MiB, pages 1-64 KiB) at "
                        "fi_rma_bw's operation counts, 5 repeats: 7-8 minutes on a 2-core machine, "
                        "where the default takes under a minute")  # fmt: skip
    p.add_argument(
        "--sizes", type=harness.size_list, default=None, metavar="LIST",
        help=f"comma-separated message sizes, 1 B to {REGION // MiB} MiB, e.g. 8,4K,64K,1M "
        "(default: the benchmark's own list)",
    )  # fmt: skip
    p.add_argument("--repeat", type=harness.positive_int, default=None, metavar="N",
                   help="repetitions per measurement (default: the benchmark's own)")  # fmt: skip
    p.add_argument("--fabtests", metavar="DIR", default=None,
                   help="also run libfabric's fi_rma_bw/fi_rdm_pingpong from DIR, alternately with "
                        "afabric's rows, and print their columns and the ratio")  # fmt: skip
    p.add_argument("--pattern", choices=tuple(PATTERNS), default=None,
                   help="where the contiguous, read and write_many rows put their operations: span "
                        "rotates through a 128 MiB region, slot by slot (memory-bound; the default "
                        "without --fabtests); fixed rewrites one buffer of the row's size at offset "
                        "0, as fi_rma_bw does (cache-resident; the default with --fabtests, so that "
                        "py/fi compares like with like)")  # fmt: skip
    p.add_argument("--hugepages", action="store_true",
                   help="both regions from afabric.host_buffer (2 MiB-aligned, advised for "
                        "transparent huge pages): same-host copies into huge pages run faster; "
                        "fi_rma_bw's buffers stay as they are")  # fmt: skip
    harness.add_loop_arguments(p, "worker")


def _copied(dst: np.ndarray, src: np.ndarray) -> np.ndarray:
    dst[:] = src
    return dst


def sweep(args: argparse.Namespace) -> str:
    """Settle quick (the default) against ``--full`` in ``args.quick``: "quick" or "full".
    Raises CommandError for both at once, or a size the target's region cannot hold."""
    full = bool(getattr(args, "full", False))
    if full and getattr(args, "quick", False):
        raise harness.CommandError("--quick and --full: give one (the default is --quick)")
    too_big = [s for s in getattr(args, "sizes", None) or [] if s > REGION]
    if too_big:
        raise harness.CommandError(
            f"--sizes {_fmt_size(too_big[0])}: larger than the target's region ({REGION // MiB} MiB)"
        )
    args.quick = not full
    return "full" if full else "quick"


SWEEPS = {
    "quick": "the default (a few sizes, fewer operations); --full: every size, 7-8 minutes on 2 cores",
    "full": "every size at fi_rma_bw's operation counts",
}


def main(args: argparse.Namespace) -> int:
    # (`--provider nvlink` runs afabric.bench.p2p_nvlink instead, which builds on this module.)
    args.sweep = sweep(args)
    args.repeat = max(1, int(getattr(args, "repeat", None) or (3 if args.quick else 5)))
    report.check_outputs(args)  # a --plot that cannot be drawn fails before the run, not after it
    args.fabtests = getattr(args, "fabtests", None)
    problem = fabtests.check_dir(args.fabtests) if args.fabtests else None
    if problem:
        print(f"afabric: error: {problem}", file=sys.stderr)
        return 2
    args.polling = getattr(args, "polling", None) or "adaptive"
    # like with like against fi_rma_bw (one cached buffer) unless asked otherwise
    args.pattern = getattr(args, "pattern", None) or ("fixed" if args.fabtests else "span")
    args.hugepages = bool(getattr(args, "hugepages", False))
    loop = getattr(args, "loop", None) or harness.default_loop()

    async def run() -> tuple[list[Row], list[Latency], str, str, str]:
        # resolve the provider here first so "auto" is decided once, for both processes
        probe = Engine(args.provider)
        provider, fabric, why = probe.provider, probe.fabric_provider, probe.provider_choice
        target = harness.Child(
            "the benchmark's target process", _target,
            (harness.PIPE, provider, args.polling, loop, args.hugepages),
        )
        try:
            async with harness.watch(target):  # a target that dies fails the run at once
                desc_blob = await target.arecv(60)
                # a default engine routes: the transport it takes to the target, said in the
                # header (and fabtests' reference is that transport's libfabric provider). A
                # single-provider engine's route is its provider: the probe does not contact
                # the target then (libfabric 1.17's shm target crashed in fi_cq_read when an
                # engine that had resolved it closed before the measuring one started).
                route = probe.route(MrDesc.from_bytes(desc_blob).owner) if provider == "auto" else provider
                await probe.aclose()
                why = f"route to the target: {route}\n{why}"
                route_fabric = _route_fabric(fabric, route) if provider == "auto" else fabric
                args.provider, args.fabric = provider, fabtests.reference_fabric(route, route_fabric)
                if args.fabtests and not route_fabric:
                    raise RuntimeError(f"--fabtests: provider {provider} is not a libfabric one")
                rows, lat, eng = await _measure(args, desc_blob)
                await eng.aclose()
            return rows, lat, fabric, why, route
        finally:
            await probe.aclose()
            target.stop("stop")
            await asyncio.get_running_loop().run_in_executor(None, target.close, 30.0)

    rows, lat, fabric, why, route = run_on_loop(run(), loop)
    header = (
        f"afabric bench p2p — provider {args.provider} ({fabric}), loop {loop}, polling {args.polling}, "
        f"{os.cpu_count()} cores, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n{why}\n"
        f"pattern {args.pattern}: {PATTERNS[args.pattern]}\n"
        f"sweep {args.sweep}, {args.repeat} repeats: {SWEEPS[args.sweep]}"
        + ("\nhuge pages: both regions from afabric.host_buffer (fi_rma_bw's buffers as they are)"
           if args.hugepages else "")
    )  # fmt: skip
    if args.fabtests and args.fabric != fabric:
        ref = args.fabric
        header += f"\nfabtests reference: libfabric {ref} (fi_rma_bw/fi_rdm_pingpong -p {ref})"
    print(render(rows, lat, header))
    if report.wants_doc(args):
        doc = {
            "bench": "p2p",
            "command": report.command_line(args),
            "provider": args.provider,
            "route": route,
            "fabric_provider": fabric,
            "loop": loop,
            "polling": args.polling,
            "pattern": args.pattern,
            "sweep": args.sweep,
            "repeat": args.repeat,
            "hugepages": args.hugepages,
            "cpus": os.cpu_count(),
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "shim": shim_path(),
            "rows": [asdict(r) | {"ratio": r.ratio} for r in rows],
            "latency": [asdict(x) for x in lat],
        }
        report.write_outputs(doc, args)
    return 0
