"""The raw C loop of contiguous writes alone, for a profiler: SIZE bytes, window 64, to a
target process, for SECONDS; prints writes/s and GB/s every second. Usage: rawloop.py
PROVIDER SIZE SECONDS (perf record -a -g while it runs: where the writer's worker, the
caller and the target's worker spend a write)."""

import asyncio
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import start_target

from afabric import Engine


async def main(prov: str, size: int, seconds: float) -> None:
    a, p, desc = start_target(prov)
    async with Engine(prov) as eng:
        mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
        await eng.write(mr, desc, size)
        rid, _ = eng._remote(desc)
        mid = mr.check(eng)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            n = 20000
            ns = eng._n.bench_write(mid, rid, size, 64, n)
            print(f"{prov} {size} B: {n / ns * 1e9:,.0f} writes/s, {n * size / ns:.2f} GB/s", flush=True)
    a.send(None)
    p.join(10)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3])))
