"""Awaited 8 B reads one at a time from a target process: p50 / p99 µs over rounds.
Usage: readlat.py PROV [ROUNDS [READS]] (uvloop; A/B by running it with two builds)."""

import asyncio
import multiprocessing as mp
import sys
import time
from typing import Any

import numpy as np
import uvloop

from afabric import Engine, MrDesc

ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
READS = int(sys.argv[3]) if len(sys.argv) > 3 else 3000


def target(conn: Any, prov: str) -> None:
    async def run() -> None:
        async with Engine(prov) as eng:
            mr = eng.register(np.ones(1 << 20, dtype=np.uint8), remote="rw")
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    uvloop.run(run())


async def main(prov: str) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    runs = []
    for _ in range(ROUNDS):
        async with Engine(prov) as eng:
            mr = eng.register(np.zeros(1 << 20, dtype=np.uint8))
            for _ in range(300):
                await eng.read(mr, desc, 8)
            xs = []
            for _ in range(READS):
                t0 = time.perf_counter_ns()
                await eng.read(mr, desc, 8)
                xs.append(time.perf_counter_ns() - t0)
            xs.sort()
            runs.append(f"{xs[len(xs) // 2] / 1e3:.1f}/{xs[int(len(xs) * 0.99)] / 1e3:.1f}")
    print(f"read {prov} 8 B p50/p99 us: {' '.join(runs)}", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
