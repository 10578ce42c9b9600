"""`afabric bench overhead`: where the microseconds of a scatter go.

For scatters to N peers (8, 16, 32, 64 by default) of one small write each, the shim's
per-operation stage stamps (``Engine(timing=True)``, see :mod:`afabric.timing`) split every
scatter into

- ``queued``: enqueue (the ctypes call) -> the worker takes the request;
- ``to_first_post``: pickup -> first work request posted (planning, first provider call);
- ``posting``: first -> last work request posted (the other N-1 posts);
- ``in_flight``: last post -> completion of the last write seen by the worker;
- ``total``: enqueue -> completion, all of the above;

and, around them, what the application sees: ``app`` is ``time.perf_counter_ns()`` around
``await eng.scatter(...)`` (the same CLOCK_MONOTONIC as the shim's stamps on Linux), split
into ``submit`` (the call -> enqueue: argument checks, building the per-target arrays, the
ctypes call), the shim's ``total`` and ``resume`` (completion -> the await returns: eventfd,
loop wake-up, drain, future, task switch).

The shim stamps "first post" when its first provider call returns, and that call posts a
whole run of up to 32 writes (one posting round): ``to_first_post`` includes posting the
first round, and ``posting`` only covers later rounds (it is near zero up to 32 peers).

The N peers are N target engines hosted by a few target processes (``--procs``, default 2;
engines are cheap: each registers a small region and reports its address and descriptor).
The initiator builds a peer group, warms every peer up (the first operation to a new peer
is slow), then issues one scatter at a time (latency mode). At the end a last scatter
carries an immediate and every target checks that it arrived with the right bytes.
Percentiles are nearest-rank. Nothing here asserts speed: it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from .. import Address, Engine, MrDesc, OpTiming, ScatterTarget
from ..errors import AfabricError
from . import harness, report
from .loops import run as run_on_loop
from .progress import Progress
from .raw import shim_path

PEERS = (8, 16, 32, 64)
SIZE = 64  # bytes per target of a scatter
SHIM_STAGES = ("queued", "to_first_post", "posting", "in_flight", "total")
STAGES = ("submit", "queued", "to_first_post", "posting", "in_flight", "resume", "total", "app")
POST_ROUND = 32  # writes per posting round of the shim's worker (AFS_POST_ROUND)
CHECK_IMM = 0xC0FFEE  # the immediate of the final, checked scatter
ITERATIONS = {8: 20000, 16: 10000, 32: 5000, 64: 2500}  # default run: ~40 s on 2 cores
QUICK_ITERATIONS = 300
PROCS = 2



def pattern(total: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The initiator's source bytes; target i receives ``pattern(...)[i*size:(i+1)*size]``."""
    return ((np.arange(total, dtype=np.uint64) * 7 + 3) % 251).astype(np.uint8)


# ---- the target processes ----


def run_targets(
    conn: Connection, provider: str, first: int, count: int, size: int, polling: str, loop: str
) -> None:
    """A target process: ``count`` engines (global indices ``first..first+count-1``), each
    registering ``size`` bytes. Sends ``[(address bytes, descriptor bytes), ...]``, then waits
    for ``(imm, peers)``: ``imm`` None ends it; otherwise every engine waits (30 s at most) for
    one arrival of ``imm``, checks its bytes against :func:`pattern` and the process answers
    ``("ok", count)`` or ``("error", why)``."""

    async def run() -> None:
        async with contextlib.AsyncExitStack() as stack:
            engines: list[Engine] = []
            bufs: list[np.ndarray[Any, np.dtype[np.uint8]]] = []
            out: list[tuple[bytes, bytes]] = []
            for _ in range(count):
                eng = await stack.enter_async_context(Engine(provider, polling=polling))
                buf = np.zeros(max(size, 64), dtype=np.uint8)
                mr = eng.register(buf)
                engines.append(eng)
                bufs.append(buf)
                out.append((bytes(eng.address), bytes(mr.descriptor)))
            conn.send(out)
            aloop = asyncio.get_running_loop()
            imm, peers = await aloop.run_in_executor(None, conn.recv)
            if imm is None:
                return
            try:
                await asyncio.gather(*(e.expect_imm(imm, 1, timeout=30.0) for e in engines))
            except AfabricError as e:
                conn.send(("error", f"targets {first}..{first + count - 1}: {e}"))
                return
            want = pattern(peers * size)
            for k, buf in enumerate(bufs):
                i = first + k
                if bytes(buf[:size]) != bytes(want[i * size : (i + 1) * size]):
                    conn.send(("error", f"target {i}: the written bytes differ"))
                    return
            conn.send(("ok", count))

    run_on_loop(run(), loop)


class _Targets:
    """The target processes of one measurement, started and stopped together; one that dies
    fails the measurement at once (:func:`afabric.bench.harness.watch`)."""

    def __init__(self, args: argparse.Namespace, peers: int) -> None:
        nprocs = max(1, min(args.procs, peers))
        per = -(-peers // nprocs)
        self.layout: list[int] = []
        self.children: list[harness.Child] = []
        first = 0
        while first < peers:
            count = min(per, peers - first)
            self.children.append(harness.Child(
                f"benchmark target process {len(self.children)}", run_targets,
                (harness.PIPE, args.provider, first, count, args.size, args.target_polling, args.loop),
            ))  # fmt: skip
            self.layout.append(count)
            first += count

    async def endpoints(self) -> list[tuple[bytes, bytes]]:
        out: list[tuple[bytes, bytes]] = []
        for c in self.children:
            out.extend(await c.arecv(60))
        return out

    async def check(self, imm: int, peers: int) -> str:
        for c in self.children:
            c.stopping = True  # each answers, then exits
            c.send((imm, peers))
        got = 0
        for c in self.children:
            state, detail = await c.arecv(60)
            if state != "ok":
                raise RuntimeError(f"benchmark target: {detail}")
            got += int(detail)
        return f"all {got} targets got the final scatter"

    async def close(self) -> None:
        aloop = asyncio.get_running_loop()
        for c in self.children:
            if not c.stopping:
                c.stop((None, 0))
        for c in self.children:
            await aloop.run_in_executor(None, c.close, 30.0)


# ---- statistics ----


def _pct(sorted_ns: Sequence[int], p: float) -> float:
    """The p-th percentile (nearest rank) in µs."""
    if not sorted_ns:
        return 0.0
    i = min(len(sorted_ns) - 1, max(0, math.ceil(p / 100.0 * len(sorted_ns)) - 1))
    return sorted_ns[i] / 1e3


@dataclass
class StageStats:
    p50_us: float = 0.0
    p99_us: float = 0.0
    p999_us: float = 0.0
    mean_us: float = 0.0
    min_us: float = 0.0
    max_us: float = 0.0

    @classmethod
    def of(cls, samples: Sequence[int]) -> StageStats:
        s = sorted(samples)
        if not s:
            return cls()
        return cls(
            _pct(s, 50.0), _pct(s, 99.0), _pct(s, 99.9), sum(s) / len(s) / 1e3, s[0] / 1e3, s[-1] / 1e3
        )


@dataclass
class PeersResult:
    peers: int
    iterations: int
    warmup: int
    target_processes: list[int]  # engines hosted by each target process
    work_requests: int  # per scatter, as the shim counted them
    stages: dict[str, StageStats] = field(default_factory=dict)
    samples_ns: dict[str, list[int]] = field(default_factory=dict)
    clock_disagreements: int = 0  # submit or resume < 0: the two clocks disagree (should be 0)
    check: str = ""
    elapsed_s: float = 0.0


def _stage_samples(timings: list[OpTiming], app: list[tuple[int, int]]) -> tuple[dict[str, list[int]], int]:
    """Per stage, one sample per scatter. ``app``: (before, after) the await of each
    scatter; timing records sorted by enqueue pair with it in issue order (scatters never
    overlap)."""
    recs = sorted((t for t in timings if t.kind == "scatter"), key=lambda t: t.t_enqueue)
    if len(recs) != len(app):
        raise RuntimeError(f"{len(recs)} scatter timing records for {len(app)} scatters")
    bad = [t for t in recs if t.status != 0 or not t.t_last_post]
    if bad:
        raise RuntimeError(f"{len(bad)} scatters failed or were never fully posted (status {bad[0].status})")
    out: dict[str, list[int]] = {s: [] for s in STAGES}
    wrs = recs[0].work_requests if recs else 0
    for t, (t0, t1) in zip(recs, app, strict=True):
        st = t.stages_ns()
        for s in SHIM_STAGES:
            out[s].append(st[s])
        out["submit"].append(t.t_enqueue - t0)
        out["resume"].append(t1 - t.t_complete)
        out["app"].append(t1 - t0)
        if t.work_requests != wrs:
            raise RuntimeError(f"a scatter posted {t.work_requests} work requests, another {wrs}")
    return out, wrs


# ---- the initiator ----


async def _measure(args: argparse.Namespace, peers: int, iterations: int) -> PeersResult:
    t_start = time.monotonic()
    targets = _Targets(args, peers)
    try:
        async with harness.watch(*targets.children):  # a target that dies fails the run at once
            eps = await targets.endpoints()
            async with Engine(args.provider, polling=args.polling, timing=True) as eng:
                src = pattern(peers * args.size)
                mr = eng.register(src, remote=False)
                group = eng.peer_group([Address.from_bytes(a) for a, _ in eps])
                tgts = [
                    ScatterTarget(MrDesc.from_bytes(d), args.size, src_offset=i * args.size)
                    for i, (_, d) in enumerate(eps)
                ]
                warmup = max(20, iterations // 20)
                for _ in range(warmup):  # connects to every peer, faults pages in, settles
                    await eng.scatter(mr, tgts, group=group)
                eng.timings()  # drop the warm-up's records
                clock = time.perf_counter_ns
                app: list[tuple[int, int]] = []
                timings: list[OpTiming] = []
                for i in range(iterations):
                    t0 = clock()
                    await eng.scatter(mr, tgts, group=group)
                    app.append((t0, clock()))
                    if i % 4096 == 4095:  # the shim keeps the newest 65,536 records
                        timings.extend(eng.timings())
                timings.extend(eng.timings())
                samples, wrs = _stage_samples(timings, app)
                await eng.scatter(mr, tgts, group=group, imm=CHECK_IMM)
            check = await targets.check(CHECK_IMM, peers)
    finally:
        await targets.close()
    res = PeersResult(peers, iterations, warmup, targets.layout, wrs, check=check)
    res.stages = {s: StageStats.of(samples[s]) for s in STAGES}
    res.samples_ns = samples
    res.clock_disagreements = sum(
        a < 0 or b < 0 for a, b in zip(samples["submit"], samples["resume"], strict=True)
    )
    res.elapsed_s = time.monotonic() - t_start
    return res


# ---- output ----

_LABELS = {
    "submit": "submit",
    "queued": "queued",
    "to_first_post": "to first post",
    "posting": "posting",
    "in_flight": "in flight",
    "resume": "resume",
    "total": "total (shim)",
    "app": "app (await)",
}


def render(results: list[PeersResult], header: str) -> str:
    out = [header, ""]
    out.append(f"{'peers':>5}  {'stage':<14} {'p50 µs':>9} {'p99 µs':>9} {'p99.9 µs':>9} {'mean µs':>9}")
    for r in results:
        for k, s in enumerate(STAGES):
            x = r.stages[s]
            peers = str(r.peers) if k == 0 else ""
            out.append(
                f"{peers:>5}  {_LABELS[s]:<14} {x.p50_us:>9.2f} {x.p99_us:>9.2f} {x.p999_us:>9.2f} "
                f"{x.mean_us:>9.2f}"
            )
        rounds = -(-r.work_requests // POST_ROUND)
        out.append(
            f"{'':>5}  ({r.iterations} scatters of {r.work_requests} writes in {rounds} posting "
            f"round{'s' if rounds != 1 else ''}; target engines per process: "
            f"{'+'.join(map(str, r.target_processes))}; {r.check})"
        )
        if r.clock_disagreements:
            out.append(
                f"{'':>5}  WARNING: {r.clock_disagreements} scatters have shim stamps outside the "
                "application's own times around them: the clocks disagree, these numbers are wrong"
            )
    out.append(
        "\nsubmit: scatter() called -> enqueued (Python checks, arrays, ctypes call); queued: -> worker "
        "pickup;\nto first post: -> the first provider call starts (building the work requests);\n"
        f"posting: -> the last provider call returned (rounds of up to {POST_ROUND} writes); in flight: -> "
        "completion; resume: -> the await returns\n(eventfd, loop wake-up, drain, future); total: "
        "enqueue -> completion (shim); app: perf_counter_ns around `await eng.scatter(...)`"
    )
    return "\n".join(out)


def _peer_list(value: Any) -> list[int]:
    if value is None:
        return list(PEERS)
    if isinstance(value, str):
        items = [int(t) for t in value.split(",") if t.strip()]
    else:
        items = [int(t) for t in value]
    if not items or any(n < 1 for n in items):
        raise ValueError(f"--peers: positive peer counts, got {value!r}")
    return items


HELP = "where a scatter's microseconds go: per-stage p50/p99/p99.9 by peer count"


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_run_arguments(p, "300 scatters per peer count (smoke run)")
    p.add_argument("--peers", type=harness.count_list, default=None, metavar="LIST",
                   help="comma-separated peer counts (default: 8,16,32,64)")
    p.add_argument("--size", type=harness.parse_size, default=None, metavar="BYTES",
                   help="bytes written to each peer per scatter (default: 64)")
    p.add_argument("--iterations", type=harness.positive_int, default=None, metavar="N",
                   help="scatters per peer count (default: 20000 for 8 peers down to 2500 for 64)")
    p.add_argument("--procs", type=harness.positive_int, default=None, metavar="N",
                   help="target processes hosting the peer engines (default: 2)")  # fmt: skip
    harness.add_loop_arguments(p, "initiator's worker")


def main(args: argparse.Namespace) -> int:
    args.quick = bool(getattr(args, "quick", False))
    args.peers = _peer_list(getattr(args, "peers", None))
    args.size = max(1, int(getattr(args, "size", None) or SIZE))
    args.procs = max(1, int(getattr(args, "procs", None) or PROCS))
    args.polling = getattr(args, "polling", None) or "adaptive"
    args.target_polling = getattr(args, "target_polling", None) or "adaptive"
    args.provider = getattr(args, "provider", None) or "auto"
    args.loop = getattr(args, "loop", None) or harness.default_loop()
    args.json = getattr(args, "json", None)
    report.check_outputs(args)  # a plot that cannot be drawn is refused before the run
    fixed = getattr(args, "iterations", None)

    def iters_for(n: int) -> int:
        if fixed is not None:
            return max(1, int(fixed))
        if args.quick:
            return QUICK_ITERATIONS
        return ITERATIONS.get(n, max(200, 16000 // n))

    async def run() -> tuple[list[PeersResult], str, str]:
        probe = Engine(args.provider)  # resolve "auto" once, for every process
        provider, fabric, why = probe.provider, probe.fabric_provider, probe.provider_choice
        await probe.aclose()
        args.provider = provider
        results: list[PeersResult] = []
        with Progress(len(args.peers)) as bar:
            for n in args.peers:
                bar.step(f"scatter to {n} peers")
                results.append(await _measure(args, n, iters_for(n)))
                bar.advance()
        return results, fabric, why

    results, fabric, why = run_on_loop(run(), args.loop)
    header = (
        f"afabric bench overhead — provider {args.provider} ({fabric}), loop {args.loop}, "
        f"polling {args.polling} (targets {args.target_polling}), {os.cpu_count()} cores, "
        f"{platform.node()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n{why}\n"
        f"one scatter at a time, {args.size} B per target, to N target engines in "
        f"{args.procs} processes; shim stage stamps (timing=True), nearest-rank percentiles"
    )
    print(render(results, header))
    if report.wants_doc(args):
        doc = {
            "bench": "overhead",
            "command": report.command_line(args),
            "provider": args.provider,
            "fabric_provider": fabric,
            "loop": args.loop,
            "polling": args.polling,
            "target_polling": args.target_polling,
            "cpus": os.cpu_count(),
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "shim": shim_path(),
            "size": args.size,
            "procs": args.procs,
            "post_round": POST_ROUND,
            "quick": args.quick,
            "stages": list(STAGES),
            "stage_definitions": {
                "queued": "t_pickup - t_enqueue",
                "to_first_post": "t_first_post - t_pickup",
                "posting": "t_last_post - t_first_post",
                "in_flight": "t_complete - t_last_post",
                "total": "t_complete - t_enqueue",
                "submit": "t_enqueue - perf_counter_ns() before `await eng.scatter(...)`",
                "resume": "perf_counter_ns() after the await - t_complete",
                "app": "perf_counter_ns() after - before `await eng.scatter(...)`",
            },
            "results": [asdict(r) for r in results],
        }
        report.write_outputs(doc, args)
    return 0
