"""The awaited 8 B write's latency distribution and the API's cost per write, against a
target process, through afabric's public API only.

- ``latency``: one write at a time, awaited; p50, p90, p99 and mean of N writes, R runs.
- ``lanes``: 64 coroutines each awaiting its own 8 B writes (as ``afabric bench p2p``'s
  lanes do); wall time per write and the loop thread's CPU time per write. Where the loop's
  thread is busy all the time (wall = CPU) its CPU time is the API's cost per operation.

Usage: python tools/latency_distribution.py PROVIDER [latency|lanes] [--writes N] [--runs R]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import time
from multiprocessing.connection import Connection

import numpy as np

from afabric import Engine, MemoryRegion, MrDesc


def _target(conn: Connection, provider: str) -> None:
    async def run() -> None:
        async with Engine(provider) as eng:
            mr = eng.register(np.ones(1 << 20, dtype=np.uint8), remote="rw")
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(run())


def start_target(provider: str) -> tuple[Connection, mp.process.BaseProcess, MrDesc]:
    """A target process with a registered 1 MiB region; send anything on the pipe to stop it."""
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_target, args=(there, provider), daemon=True)
    proc.start()
    return here, proc, MrDesc.from_bytes(here.recv())


async def latency(eng: Engine, mr: MemoryRegion, desc: MrDesc, writes: int, runs: int) -> None:
    for _ in range(min(500, writes)):
        await eng.write(mr, desc, 8)
    clock = time.perf_counter_ns
    for _ in range(runs):
        samples = []
        for _ in range(writes):
            t0 = clock()
            await eng.write(mr, desc, 8)
            samples.append(clock() - t0)
        samples.sort()
        n = len(samples)
        print(
            f"latency {eng.provider}: p50 {samples[n // 2] / 1e3:.2f} p90 {samples[n * 9 // 10] / 1e3:.2f} "
            f"p99 {samples[n * 99 // 100] / 1e3:.2f} mean {sum(samples) / n / 1e3:.2f} µs ({n} writes)",
            flush=True,
        )


async def lanes(eng: Engine, mr: MemoryRegion, desc: MrDesc, writes: int, runs: int, width: int = 64) -> None:
    async def run(n: int) -> tuple[float, float]:
        per = max(1, n // width)

        async def lane() -> None:
            for _ in range(per):
                await eng.write(mr, desc, 8)

        t0, c0 = time.perf_counter(), time.thread_time()
        await asyncio.gather(*(lane() for _ in range(width)))
        ops = per * width
        return (time.perf_counter() - t0) / ops * 1e6, (time.thread_time() - c0) / ops * 1e6

    await run(writes // 3)
    results = [await run(writes) for _ in range(runs)]
    wall, cpu = sorted(w for w, _ in results), sorted(c for _, c in results)
    print(
        f"lanes {eng.provider}: {width} lanes, "
        f"wall µs/write min {wall[0]:.2f} median {wall[len(wall) // 2]:.2f}; "
        f"loop thread CPU µs/write min {cpu[0]:.2f} median {cpu[len(cpu) // 2]:.2f}",
        flush=True,
    )


async def main(ns: argparse.Namespace) -> None:
    conn, proc, desc = start_target(ns.provider)
    try:
        async with Engine(ns.provider) as eng:
            mr = eng.register(np.ones(4096, dtype=np.uint8), remote=False)
            if ns.mode == "latency":
                await latency(eng, mr, desc, ns.writes, ns.runs)
            else:
                await lanes(eng, mr, desc, ns.writes, ns.runs)
    finally:
        conn.send("stop")
        proc.join(10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("provider")
    ap.add_argument("mode", nargs="?", choices=("latency", "lanes"), default="latency")
    ap.add_argument("--writes", type=int, default=20_000)
    ap.add_argument("--runs", type=int, default=3)
    ns = ap.parse_args()
    try:
        import uvloop

        uvloop.run(main(ns))
    except ImportError:
        asyncio.run(main(ns))
