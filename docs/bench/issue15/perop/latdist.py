"""The awaited 8 B write's distribution, one at a time to a target process: p50, p90, p99 and
mean of 20,000 writes, three times (uvloop). Usage: latdist.py PROVIDER"""

import os
import sys
import time

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import start_target

from afabric import Engine


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    async with Engine(prov) as eng:
        mr = eng.register(np.ones(4096, dtype=np.uint8))
        for _ in range(500):
            await eng.write(mr, desc, 8)
        clk = time.perf_counter_ns
        for _run in range(3):
            s: list[int] = []
            for _ in range(20000):
                t0 = clk()
                await eng.write(mr, desc, 8)
                s.append(clk() - t0)
            s.sort()
            n = len(s)
            print(f"LAT {prov} p50 {s[n // 2] / 1e3:.2f} p90 {s[int(n * 0.9)] / 1e3:.2f} "
                  f"p99 {s[int(n * 0.99)] / 1e3:.2f} mean {sum(s) / n / 1e3:.2f}", flush=True)  # fmt: skip
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
