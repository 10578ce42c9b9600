"""Does where the threads run move an awaited 8 B write? The writer's loop thread pinned to
one CPU (os.sched_setaffinity), its engine's worker to another (Engine(cpu=...)), the target
process to a set of others; p50 / p99 µs over 4000 writes one at a time, and the machine's
SMT siblings of the loop's CPU. Usage: placement.py PROV LOOP_CPU WORKER_CPU TARGET_CPUS
(TARGET_CPUS: comma list, or "-" for none; LOOP_CPU -1: nothing pinned; WORKER_CPU -1: the
worker inherits the loop's CPU)."""

import asyncio
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from afabric import Engine, MrDesc

N = 4000


def target(conn: Any, prov: str, cpus: set[int]) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)

    async def run() -> None:
        async with Engine(prov) as eng:
            mr = eng.register(np.zeros(1 << 20, dtype=np.uint8))
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    uvloop.run(run())


def siblings(cpu: int) -> str:
    p = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    return p.read_text().strip() if p.exists() else "?"


async def main(prov: str, loop_cpu: int, worker_cpu: int, target_cpus: set[int]) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov, target_cpus), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    if loop_cpu >= 0:
        os.sched_setaffinity(0, {loop_cpu} if worker_cpu < 0 else {loop_cpu, worker_cpu})
    async with Engine(prov, cpu=None if worker_cpu < 0 else worker_cpu) as eng:
        if loop_cpu >= 0:
            os.sched_setaffinity(0, {loop_cpu})  # the loop's thread alone; the worker keeps its own
        mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
        for _ in range(500):
            await eng.write(mr, desc, 8)
        lat = []
        for _ in range(N):
            t0 = time.perf_counter_ns()
            await eng.write(mr, desc, 8)
            lat.append(time.perf_counter_ns() - t0)
        lat.sort()
        print(
            f"PLACE {prov} loop {loop_cpu} (siblings {siblings(loop_cpu)}) worker {worker_cpu} "
            f"target {sorted(target_cpus)}: p50 {statistics.median(lat) / 1e3:.2f} "
            f"p99 {lat[int(0.99 * N)] / 1e3:.2f} us",
            flush=True,
        )
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    prov, lc, wc, tc = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    uvloop.run(main(prov, lc, wc, {int(c) for c in tc.split(",") if c != "-"}))
