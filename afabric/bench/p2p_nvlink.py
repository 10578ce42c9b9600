"""`afabric bench p2p --provider nvlink`: GPU-to-GPU writes between two processes of one node,
against the CUDA peer copy (``cudaMemcpyPeerAsync``) of the same bytes in the same run.

A target process owns a region on the second GPU (on a one-GPU machine the same GPU: the
colocated case, and the baseline is then a device-to-device copy on it); this process writes into it from a
region on the first GPU through the Python API (W coroutines each awaiting its writes) and
through the shim's raw C loop (same submit path, no Python per operation). The baseline is
what the GPUs themselves do: back-to-back ``cudaMemcpyPeerAsync`` of the same sizes on one
stream, synchronised once, in this process (first GPU to second). Paged rows move 16,384
shuffled pages per write (one copy kernel for all of them) against one contiguous peer copy
of the same bytes. Every number is the median of repeated runs; nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import Engine, MemoryRegion, MrDesc, Pages
from . import harness, report
from .loops import run as run_on_loop
from .p2p import Latency, _fmt_size, _latency, _py_paged, _py_writes, _window_for
from .progress import Progress
from .raw import RawLoop

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
CONTIG_SIZES = [4 * KiB, 64 * KiB, 1 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 * GiB]
QUICK_CONTIG = [4 * KiB, 1 * MiB, 16 * MiB, 256 * MiB, 1 * GiB]
PAGE_SIZES = [4 * KiB, 8 * KiB, 16 * KiB, 32 * KiB, 64 * KiB]
QUICK_PAGES = [4 * KiB, 32 * KiB, 64 * KiB]
PAGES_PER_OP = 16384  # the KV-cache case of the issue: 16,384 shuffled pages per write
REGION = 1 * GiB
SRC_GPU = 0


def _dst_gpu(cp: Any) -> int:
    """The target's GPU: the second one, or the first on a one-GPU machine."""
    return 1 if int(cp.cuda.runtime.getDeviceCount()) >= 2 else 0


@dataclass
class Row:
    kind: str  # "write" or "paged"
    size: int  # bytes per write, or per page
    ops_per_call: int
    window: int
    py_gbps: float = 0.0
    raw_gbps: float = 0.0
    peer_gbps: float = 0.0

    @property
    def py_ratio(self) -> float:
        return self.py_gbps / self.peer_gbps if self.peer_gbps else 0.0

    @property
    def raw_ratio(self) -> float:
        return self.raw_gbps / self.peer_gbps if self.peer_gbps else 0.0


def _cupy() -> Any:
    harness.require("afabric bench p2p --provider nvlink", "cupy")  # ImportError, or CUDA libraries missing
    import cupy

    if int(cupy.cuda.runtime.getDeviceCount()) < 1:
        raise harness.CommandError("afabric bench p2p --provider nvlink needs a CUDA GPU")
    return cupy


def _target(conn: Connection, polling: str, loop: str) -> None:
    async def run() -> None:
        cp = _cupy()
        with cp.cuda.Device(_dst_gpu(cp)):
            buf = cp.zeros(REGION, dtype=cp.uint8)
        async with Engine("nvlink", nic=f"cuda{_dst_gpu(cp)}", polling=polling) as eng:
            mr = eng.register(buf)
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    run_on_loop(run(), loop)


def _iters(nbytes: int, quick: bool) -> int:
    budget = (2 if quick else 8) * GiB
    return int(max(16, min(5000 if quick else 20000, budget // max(nbytes, 1))))


def _peer_copies(cp: Any, dst: Any, src: Any, sizes: list[tuple[int, int, int]], repeat: int) -> float:
    """Seconds per round of ``cudaMemcpyPeerAsync(dst+d, dst GPU, src+s, SRC_GPU, n)`` for
    each (s, d, n) of ``sizes``, issued back to back on one stream (median of rounds)."""
    rt, dst_gpu = cp.cuda.runtime, _dst_gpu(cp)
    with cp.cuda.Device(SRC_GPU):
        stream = cp.cuda.Stream(non_blocking=True)
        times = []
        for r in range(repeat + 1):
            stream.synchronize()
            t0 = time.perf_counter()
            for s, d, n in sizes:
                rt.memcpyPeerAsync(dst.data.ptr + d, dst_gpu, src.data.ptr + s, SRC_GPU, n, stream.ptr)
            stream.synchronize()
            if r:  # the first round warms up
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _median_rate(nbytes: int, runs: list[float]) -> float:
    return nbytes / statistics.median(runs) / 1e9


class _Setup:
    """The engine, source region and imported descriptor every row writes with, and the
    baseline's buffers."""

    def __init__(self, cp: Any, eng: Engine, mr: MemoryRegion, desc: MrDesc, src: Any, peer_dst: Any) -> None:
        self.cp, self.eng, self.mr, self.desc, self.src, self.peer_dst = cp, eng, mr, desc, src, peer_dst
        self.raw = RawLoop(eng, mr, desc)  # the raw loop drives the same imported descriptor


async def _write_row(t: _Setup, size: int, args: argparse.Namespace) -> Row:
    window, iters = _window_for(size), _iters(size, args.quick)
    span = max(1, REGION // size)
    py: list[float] = []
    raw: list[float] = []
    for _ in range(args.repeat):
        py.append(await _py_writes(t.eng, t.mr, t.desc, size, window, iters))
        raw.append(t.raw.write(size, window, iters) / 1e9 / iters)
    plan = [((i % span) * size, (i % span) * size, size) for i in range(iters)]
    peer = _peer_copies(t.cp, t.peer_dst, t.src, plan, args.repeat) / iters
    row = Row("write", size, 1, window, _median_rate(size, py), _median_rate(size, raw))
    row.peer_gbps = size / peer / 1e9
    return row


async def _paged_row(t: _Setup, page: int, rng: np.random.Generator, args: argparse.Namespace) -> Row:
    npages = REGION // page
    count, window = min(PAGES_PER_OP, npages), 4
    iters = _iters(page * count, args.quick)
    s_idx = rng.permutation(npages)[:count].astype(np.int64)
    d_idx = rng.permutation(npages)[:count].astype(np.int64)
    sp, dp = Pages(s_idx, page), Pages(d_idx, page)
    py: list[float] = []
    raw: list[float] = []
    for _ in range(args.repeat):
        py.append(await _py_paged(t.eng, t.mr, t.desc, page, sp, dp, window, iters))
        raw.append(t.raw.paged(page, s_idx, d_idx, window, iters) / 1e9 / iters)
    nbytes = page * count
    peer = _peer_copies(t.cp, t.peer_dst, t.src, [(0, 0, nbytes)] * iters, args.repeat) / iters
    row = Row("paged", page, count, window, _median_rate(nbytes, py), _median_rate(nbytes, raw))
    row.peer_gbps = nbytes / peer / 1e9
    return row


async def _measure(args: argparse.Namespace, desc_blob: bytes) -> tuple[list[Row], Latency]:
    cp = _cupy()
    with cp.cuda.Device(SRC_GPU):
        src = (cp.arange(REGION, dtype=cp.uint32) * 2654435761 >> 13).astype(cp.uint8)
    with cp.cuda.Device(_dst_gpu(cp)):
        peer_dst = cp.zeros(REGION, dtype=cp.uint8)  # the baseline's destination, this process
    sizes = args.sizes or (QUICK_CONTIG if args.quick else CONTIG_SIZES)
    pages = QUICK_PAGES if args.quick else PAGE_SIZES
    bar = Progress(len(sizes) + len(pages) + 1)
    rows: list[Row] = []
    async with Engine("nvlink", nic=f"cuda{SRC_GPU}", polling=args.polling) as eng:
        desc = MrDesc.from_bytes(desc_blob)
        t = _Setup(cp, eng, eng.register(src, remote=False), desc, src, peer_dst)
        for size in sizes:
            bar.step(f"write {_fmt_size(size)}")
            rows.append(await _write_row(t, size, args))
            bar.advance()
        rng = np.random.default_rng(1)
        for page in pages:
            bar.step(f"paged {_fmt_size(page)}/pg")
            rows.append(await _paged_row(t, page, rng, args))
            bar.advance()
        bar.step("latency 8 B")
        lat = await _latency(eng, t.mr, desc, 8, args.quick)
    bar.close()
    return rows, lat


def render(rows: list[Row], lat: Latency, header: str) -> str:
    out = [header, ""]
    out.append(
        f"{'op':<6} {'size':>9} {'pages':>6} {'win':>4} {'py GB/s':>9} {'raw GB/s':>9} "
        f"{'peer GB/s':>10} {'py/peer':>8} {'raw/peer':>9}"
    )
    for r in rows:
        size = _fmt_size(r.size) + ("/pg" if r.kind == "paged" else "")
        out.append(
            f"{r.kind:<6} {size:>9} {r.ops_per_call:>6} {r.window:>4} {r.py_gbps:>9.1f} {r.raw_gbps:>9.1f} "
            f"{r.peer_gbps:>10.1f} {r.py_ratio:>8.2f} {r.raw_ratio:>9.2f}"
        )
    out.append(
        "peer: cudaMemcpyPeerAsync of the same bytes between the header's GPUs (one GPU: a device-to-device "
        "copy on it), back to back on one stream "
        "(paged rows: one contiguous copy of all the pages' bytes)"
    )
    out.append(
        f"awaited {lat.size} B write, one at a time: p50 {lat.p50_us:.1f} µs, p99 {lat.p99_us:.1f} µs "
        f"(raw C loop: p50 {lat.raw_p50_us:.1f}, p99 {lat.raw_p99_us:.1f}, mean {lat.raw_mean_us:.1f} µs; "
        f"{lat.samples} samples)"
    )
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    if getattr(args, "plot", None):
        raise harness.CommandError("afabric bench p2p --provider nvlink writes --json only (no --plot)")
    if getattr(args, "full", False) and getattr(args, "quick", False):
        raise harness.CommandError("--quick and --full: give one (the default is --quick)")
    args.quick = not getattr(args, "full", False)  # quick unless --full, as the host rows
    args.repeat = max(1, int(getattr(args, "repeat", None) or 3))
    args.polling = getattr(args, "polling", None) or "adaptive"
    args.sizes = getattr(args, "sizes", None)
    loop = getattr(args, "loop", None) or harness.default_loop()
    dst_gpu = _dst_gpu(_cupy())

    async def run() -> tuple[list[Row], Latency]:
        target = harness.Child("the benchmark's target process", _target, (harness.PIPE, args.polling, loop))
        try:
            async with harness.watch(target):  # a target that dies fails the run at once
                return await _measure(args, await target.arecv(120))
        finally:
            target.stop("stop")
            await asyncio.get_running_loop().run_in_executor(None, target.close, 30.0)

    rows, lat = run_on_loop(run(), loop)
    header = (
        f"afabric bench p2p — provider nvlink, GPU{SRC_GPU} -> GPU{dst_gpu} (two processes), "
        f"loop {loop}, polling {args.polling}, {os.cpu_count()} cores, {platform.node()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    print(render(rows, lat, header))
    if report.wants_doc(args):
        doc = {
            "bench": "p2p-nvlink",
            "command": report.command_line(args),
            "provider": "nvlink",
            "loop": loop,
            "polling": args.polling,
            "cpus": os.cpu_count(),
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "rows": [asdict(r) | {"py_ratio": r.py_ratio, "raw_ratio": r.raw_ratio} for r in rows],
            "latency": [asdict(lat)],
        }
        report.write_outputs(doc, args)
    return 0
