"""`afabric bench trigger`: from a watcher change to the write it releases.

A target process registers memory and publishes its descriptor (as in ``bench p2p``). Here
a writer thread plays the model: it bumps a watcher word once per "layer", a few hundred
microseconds apart. A bump is a plain store of the next value into the word, as a GPU
kernel's is (the writer is the word's only one), made in C by the shim, which reads the
clock (``time.monotonic_ns()``'s) just before the store: timed from Python, the bump took
the writer's own way to the store with it (``UvmWatcher.add``: a ctypes call after the
clock, 1.6-3.3 µs on the 2-core machine; a numpy store into the word, just woken from its
sleep, 1.0 µs at the median there), which is the caller's cost, not the trigger's. Each bump
must release one small write with an immediate to the target, two ways, on the same engines:

- ``triggered``: the writes are armed ahead with ``when=watcher.reaches(k)``; the shim's
  worker posts write k itself once its watcher thread sees the word reach k;
- ``python``: ``async for old, new in watcher`` creates the write's task in the loop body
  (the idiomatic asyncio reaction, no await between seeing the change and submitting).

The latency of one iteration is the time the write's first work request was posted (the
shim stamps it with CLOCK_MONOTONIC, which is also ``time.monotonic_ns()``'s clock) minus
the time of the bump. The writer bumps again only after the previous write completed, so
iterations never overlap and the i-th completion belongs to the i-th bump (checked).
Blocks of the two modes alternate so that drift on the machine hits both alike; at the
end the target checks that every write arrived. Nothing here asserts speed: it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import math
import os
import platform
import queue
import random
import threading
import time
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection

import numpy as np

from .. import Engine, MemoryRegion, MrDesc, UvmWatcher
from ..errors import AfabricError
from . import harness, report
from .loops import run as run_on_loop
from .progress import Progress
from .raw import record_first_posts, shim_path, watcher_store

SIZE = 64  # bytes per write (a small "layer done" payload; the immediate is what counts)
REGION = 1 << 16
PACE_US = (200.0, 500.0)  # gap between bumps, drawn uniformly: "layers finishing"
ARM_AHEAD = 4  # triggered mode keeps this many writes armed
WARMUP = 10  # first iterations of every block, measured but not counted
GOAL_P99_RATIO = 5.0  # the goal: triggered p99 at least 5x lower than python's
MODES = ("triggered", "python")
PERCENTILES = (0.0, 1.0, 10.0, 25.0, 50.0, 75.0, 90.0, 99.0, 99.9, 100.0)



@dataclass
class ModeResult:
    mode: str
    samples: int = 0
    p50_us: float = 0.0
    p90_us: float = 0.0
    p99_us: float = 0.0
    p999_us: float = 0.0
    min_us: float = 0.0
    max_us: float = 0.0
    mean_us: float = 0.0
    percentiles_us: dict[str, float] = field(default_factory=dict)
    histogram: list[dict[str, float]] = field(default_factory=list)  # log2 buckets of µs
    per_block_p50_us: list[float] = field(default_factory=list)
    per_block_p99_us: list[float] = field(default_factory=list)
    # Sanity: a write is posted after its bump and (iterations never overlap) before the
    # next one. A stamp before its bump means the shim's first-post clock is stale.
    before_change: int = 0
    after_next_change: int = 0
    samples_ns: list[int] = field(default_factory=list)


# ---- the target process ----


def run_target(conn: Connection, provider: str, polling: str = "adaptive", loop: str = "asyncio") -> None:
    """The target process (also used by tests/gpu): registers REGION bytes, sends
    ``(descriptor bytes, imm)``, then waits for ``(count, prefix)``: ``count`` None ends
    it; otherwise it waits (30 s at most) for ``count`` arrivals of ``imm``, checks that
    the region starts with ``prefix`` and answers ``("ok", count)`` or ``("error", why)``."""

    async def run() -> None:
        async with Engine(provider, polling=polling) as eng:
            buf = np.zeros(REGION, dtype=np.uint8)
            mr = eng.register(buf)
            imm = eng.alloc_imm()
            conn.send((bytes(mr.descriptor), imm))
            aloop = asyncio.get_running_loop()
            total, pattern = await aloop.run_in_executor(None, conn.recv)
            if total is None:
                return
            try:
                await eng.expect_imm(imm, int(total), timeout=30.0)
            except AfabricError as e:
                conn.send(("error", f"{total} arrivals expected: {e}"))
                return
            ok = bytes(buf[: len(pattern)]) == bytes(pattern)
            conn.send(("ok", int(total)) if ok else ("error", "write payload differs"))

    run_on_loop(run(), loop)


# ---- the writer thread (the "model") ----


def _writer(
    eng: Engine, w: UvmWatcher, n: int, go: queue.SimpleQueue[bool], t_change: list[int], seed: int,
    errs: list[str],
) -> None:
    """Bump n times; before bump k wait for the loop's go (write k-1 done), then a paced gap."""
    rng = random.Random(seed)
    lo, hi = PACE_US[0] / 1e6, PACE_US[1] / 1e6
    store = watcher_store(eng, w)  # the block closes the watcher after this returns
    try:
        for k in range(n):
            if not go.get():
                return
            time.sleep(rng.uniform(lo, hi))
            t_change[k] = store(k + 1)  # the clock, read in C just before the store
    except BaseException as e:  # noqa: BLE001 - reported by the block that started it
        errs.append(f"{type(e).__name__}: {e}")


class _Block:
    """One block of n iterations of one mode on a fresh watcher."""

    def __init__(self, eng: Engine, n: int, seed: int) -> None:
        self.eng = eng
        self.n = n
        self.w = eng.uvm_watcher()
        self.go: queue.SimpleQueue[bool] = queue.SimpleQueue()
        self.t_change = [0] * n
        self.errs: list[str] = []
        self.posts: collections.deque[tuple[int, int]] = collections.deque()
        record_first_posts(eng, self.posts)
        self.thread = threading.Thread(
            target=_writer, args=(eng, self.w, n, self.go, self.t_change, seed, self.errs),
            name="afabric-bench-writer", daemon=True,
        )  # fmt: skip

    def start(self) -> None:
        self.thread.start()
        self.go.put(True)

    async def finish(self) -> None:
        self.go.put(False)  # in case the writer still waits (an error cut the block short)
        await asyncio.get_running_loop().run_in_executor(None, self.thread.join, 10.0)
        record_first_posts(self.eng, None)
        self.w.close()
        if self.thread.is_alive():
            raise RuntimeError("benchmark writer thread did not stop")
        if self.errs:
            raise RuntimeError(f"benchmark writer failed: {self.errs[0]}")

    def latencies(self) -> list[tuple[int, int]]:
        """Per iteration: (first post minus bump in ns, 0 if the post lies between its bump
        and the next bump, -1 if it is stamped before its bump, 1 if after the next one)."""
        posts = [t for _, t in self.posts]
        if len(posts) != self.n:
            raise RuntimeError(f"{len(posts)} first-post records for {self.n} writes")
        out = []
        for k, (t0, t1) in enumerate(zip(self.t_change, posts, strict=True)):
            nxt = self.t_change[k + 1] if k + 1 < self.n else None
            where = -1 if t1 < t0 else 1 if nxt is not None and t1 > nxt else 0
            out.append((t1 - t0, where))
        return out


async def _triggered(eng: Engine, mr: MemoryRegion, desc: MrDesc, imm: int, n: int, seed: int) -> _Block:
    b = _Block(eng, n, seed)
    armed: dict[int, asyncio.Task[None]] = {}

    def arm(k: int) -> None:
        armed[k] = asyncio.ensure_future(eng.write(mr, desc, SIZE, imm=imm, when=b.w.reaches(k)))

    try:
        for k in range(1, min(n, ARM_AHEAD) + 1):
            arm(k)
        await asyncio.sleep(0)  # the tasks run up to their await: armed in the shim
        b.start()
        for k in range(1, n + 1):
            await armed.pop(k)
            if k + ARM_AHEAD <= n:
                arm(k + ARM_AHEAD)
                await asyncio.sleep(0)
            if k < n:
                b.go.put(True)
    finally:
        for t in armed.values():
            t.cancel()
        if armed:
            await asyncio.gather(*armed.values(), return_exceptions=True)
        await b.finish()
    return b


async def _python(eng: Engine, mr: MemoryRegion, desc: MrDesc, imm: int, n: int, seed: int) -> _Block:
    b = _Block(eng, n, seed)
    tasks: set[asyncio.Task[None]] = set()
    failed: list[BaseException] = []

    def done(t: asyncio.Task[None]) -> None:
        tasks.discard(t)
        if t.cancelled():
            return
        exc = t.exception()
        if exc is not None:
            failed.append(exc)
            b.go.put(False)
        else:
            b.go.put(True)

    try:
        b.start()
        async for old, new in b.w:
            for _ in range(old, new):  # one write per step (steps never merge here)
                t = asyncio.ensure_future(eng.write(mr, desc, SIZE, imm=imm))
                tasks.add(t)
                t.add_done_callback(done)
            if new >= n or failed:
                break
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if failed:
            raise failed[0]
    finally:
        await b.finish()
    return b


# ---- statistics ----


def _pct(sorted_ns: list[int], p: float) -> float:
    """The p-th percentile (nearest rank) in µs."""
    if not sorted_ns:
        return 0.0
    i = min(len(sorted_ns) - 1, max(0, math.ceil(p / 100.0 * len(sorted_ns)) - 1))
    return sorted_ns[i] / 1e3


def _histogram(sorted_ns: list[int]) -> list[dict[str, float]]:
    """Counts per power-of-two bucket of microseconds: [lo, hi)."""
    counts: collections.Counter[int] = collections.Counter()
    for v in sorted_ns:
        us = max(v, 0) / 1e3
        counts[0 if us < 1 else int(us).bit_length()] += 1
    return [
        {"lo_us": 0.0 if b == 0 else float(1 << (b - 1)), "hi_us": float(1 << b), "count": float(c)}
        for b, c in sorted(counts.items())
    ]


def _summarize(mode: str, blocks: list[list[tuple[int, int]]]) -> ModeResult:
    samples = [v for block in blocks for v, _ in block]
    s = sorted(samples)
    r = ModeResult(mode, samples=len(s))
    if not s:
        return r
    r.p50_us, r.p90_us, r.p99_us, r.p999_us = (_pct(s, p) for p in (50.0, 90.0, 99.0, 99.9))
    r.min_us, r.max_us = s[0] / 1e3, s[-1] / 1e3
    r.mean_us = sum(s) / len(s) / 1e3
    r.percentiles_us = {f"p{p:g}": _pct(s, p) for p in PERCENTILES}
    r.histogram = _histogram(s)
    for block in blocks:
        b = sorted(v for v, _ in block)
        r.per_block_p50_us.append(_pct(b, 50.0))
        r.per_block_p99_us.append(_pct(b, 99.0))
    r.before_change = sum(where < 0 for block in blocks for _, where in block)
    r.after_next_change = sum(where > 0 for block in blocks for _, where in block)
    r.samples_ns = samples
    return r


# ---- the run ----


@dataclass
class Outcome:
    results: dict[str, ModeResult]
    fabric: str
    why: str
    target: str
    rounds: int


async def _measure(args: argparse.Namespace, desc_blob: bytes, imm: int) -> tuple[dict[str, ModeResult], int]:
    async with Engine(args.provider, polling=args.polling) as eng:
        desc = MrDesc.from_bytes(desc_blob)
        src = np.arange(REGION, dtype=np.uint64).astype(np.uint8)
        mr = eng.register(src, remote=False)
        for _ in range(50):  # connect, fault in, settle
            await eng.write(mr, desc, SIZE, imm=imm)
        writes = 50
        per_block = -(-args.iterations // args.rounds)
        raw: dict[str, list[list[tuple[int, int]]]] = {m: [] for m in MODES}
        left = dict.fromkeys(MODES, args.iterations)
        with Progress(len(MODES) * args.iterations) as bar:  # on stderr, when it is a terminal
            for r in range(args.rounds):
                order = MODES if r % 2 == 0 else MODES[::-1]
                for mode in order:
                    n = min(per_block, left[mode])
                    if n <= 0:
                        continue
                    bar.step(f"round {r + 1}/{args.rounds} {mode}")
                    fn = _triggered if mode == "triggered" else _python
                    limit = 30.0 + (n + WARMUP) * 0.05  # a stuck block fails instead of hanging
                    block = await asyncio.wait_for(
                        fn(eng, mr, desc, imm, n + WARMUP, seed=r * 2 + (mode == "python")), limit
                    )
                    writes += n + WARMUP
                    raw[mode].append(block.latencies()[WARMUP:])
                    left[mode] -= n
                    bar.advance(n)
        return {m: _summarize(m, raw[m]) for m in MODES}, writes


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else 0.0


def _counts(d: dict[str, int]) -> str:
    return ", ".join(f"{m}: {n}" for m, n in d.items())


def render(res: dict[str, ModeResult], header: str) -> str:
    out = [header, ""]
    out.append(
        f"{'mode':<10} {'samples':>8} {'p50 µs':>9} {'p90 µs':>9} {'p99 µs':>9} {'p99.9 µs':>9} "
        f"{'max µs':>9} {'mean µs':>9}"
    )
    for m in MODES:
        x = res[m]
        out.append(
            f"{m:<10} {x.samples:>8} {x.p50_us:>9.1f} {x.p90_us:>9.1f} {x.p99_us:>9.1f} "
            f"{x.p999_us:>9.1f} {x.max_us:>9.1f} {x.mean_us:>9.1f}"
        )
    t, p = res["triggered"], res["python"]
    r50, r99 = _ratio(p.p50_us, t.p50_us), _ratio(p.p99_us, t.p99_us)
    met = "met" if r99 >= GOAL_P99_RATIO else "NOT met"
    out.append(
        f"\npython/triggered: p50 {r50:.2f}x, p99 {r99:.2f}x, p99.9 {_ratio(p.p999_us, t.p999_us):.2f}x "
        f"(goal: triggered p99 at least {GOAL_P99_RATIO:g}x lower: {met})"
    )
    early = {m: res[m].before_change for m in MODES if res[m].before_change}
    late = {m: res[m].after_next_change for m in MODES if res[m].after_next_change}
    if early:
        out.append(
            f"WARNING: first-post stamps earlier than their bump ({_counts(early)}): the shim's "
            "stamp is not the time of the post (a stale clock reading), so these numbers are wrong"
        )
    if late:
        out.append(f"warning: writes first posted after the next bump ({_counts(late)})")
    return "\n".join(out)


HELP = "latency from a watcher change to the write it releases: triggered vs Python loop"


def add_arguments(p: argparse.ArgumentParser) -> None:
    harness.add_run_arguments(p, "300 iterations per mode (smoke run)")
    p.add_argument("--iterations", type=harness.positive_int, default=None, metavar="N",
                   help="iterations per mode (default: 2000, or 300 with --quick)")  # fmt: skip
    harness.add_loop_arguments(p, "worker")


def main(args: argparse.Namespace) -> int:
    quick = bool(getattr(args, "quick", False))
    iters = getattr(args, "iterations", None)
    args.iterations = max(1, int(iters if iters is not None else (300 if quick else 2000)))
    args.rounds = max(1, min(args.iterations, 2 if quick else 4))
    args.polling = getattr(args, "polling", None) or "adaptive"
    args.provider = getattr(args, "provider", None) or "auto"
    loop = getattr(args, "loop", None) or harness.default_loop()
    report.check_outputs(args)  # a --plot that cannot be drawn fails before the run, not after it

    async def run() -> Outcome:
        probe = Engine(args.provider)  # resolve "auto" once, for both processes
        provider, fabric, why = probe.provider, probe.fabric_provider, probe.provider_choice
        await probe.aclose()
        args.provider = provider
        target = harness.Child(
            "the benchmark's target process", run_target, (harness.PIPE, provider, args.polling, loop)
        )
        sent_stop = False
        try:
            async with harness.watch(target):  # a target that dies fails the run at once
                desc_blob, imm = await target.arecv(60)
                res, writes = await _measure(args, desc_blob, imm)
                target.stopping = True  # it answers, then exits
                target.send((writes, bytes(np.arange(SIZE, dtype=np.uint64).astype(np.uint8))))
                sent_stop = True
                state, detail = await target.arecv(60)
            if state != "ok":
                raise RuntimeError(f"benchmark target: {detail}")
            return Outcome(res, fabric, why, f"all {detail} writes arrived", args.rounds)
        finally:
            if not sent_stop:
                target.stop((None, b""))
            await asyncio.get_running_loop().run_in_executor(None, target.close, 30.0)

    o = run_on_loop(run(), loop)
    header = (
        f"afabric bench trigger — provider {args.provider} ({o.fabric}), loop {loop}, "
        f"polling {args.polling}, {os.cpu_count()} cores, {platform.node()}, "
        f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n{o.why}\n"
        f"watcher change -> first work request of the write it releases ({SIZE} B + immediate); "
        f"{args.iterations} iterations per mode in {o.rounds} alternating blocks, bumps "
        f"{PACE_US[0]:g}-{PACE_US[1]:g} µs apart by a Python thread (stores into the word, as a "
        f"kernel's, clocked in C just before the store), {ARM_AHEAD} armed ahead; {o.target}"
    )
    print(render(o.results, header))
    if report.wants_doc(args):
        t, p = o.results["triggered"], o.results["python"]
        ratio_p99 = _ratio(p.p99_us, t.p99_us)
        doc = {
            "bench": "trigger",
            "command": report.command_line(args),
            "provider": args.provider,
            "fabric_provider": o.fabric,
            "loop": loop,
            "polling": args.polling,
            "cpus": os.cpu_count(),
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "shim": shim_path(),
            "size": SIZE,
            "iterations": args.iterations,
            "rounds": o.rounds,
            "warmup_per_block": WARMUP,
            "pace_us": list(PACE_US),
            "arm_ahead": ARM_AHEAD,
            "latency": "first work request posted (shim) - CLOCK_MONOTONIC read just before the bump's store",
            "target": o.target,
            "modes": {m: asdict(o.results[m]) for m in MODES},
            "ratio_python_over_triggered": {
                "p50": _ratio(p.p50_us, t.p50_us),
                "p99": ratio_p99,
                "p99.9": _ratio(p.p999_us, t.p999_us),
            },
            "goal": {"p99_ratio_at_least": GOAL_P99_RATIO, "met": ratio_p99 >= GOAL_P99_RATIO},
        }
        report.write_outputs(doc, args)
    return 0
