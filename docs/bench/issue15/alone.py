"""An awaited write alone, in one process (writer and target engines side by side): the p50
of 20,000 `await eng.write(mr, desc, 8)` five times over, for the provider given. With
nothing else in flight the write takes the submit-and-look path (Engine._alone), so this
is the Python cost of that path plus the round trip. Usage: alone.py PROVIDER"""

import asyncio
import sys
import time

import numpy as np

from afabric import Engine


async def main(prov: str) -> None:
    async with Engine(prov) as a, Engine(prov) as b:
        mr = a.register(np.ones(4096, dtype=np.uint8))
        desc = b.register(np.zeros(4096, dtype=np.uint8)).descriptor
        for _ in range(500):
            await a.write(mr, desc, 8)
        clock = time.perf_counter_ns
        p50s = []
        for _ in range(5):
            s = []
            for _ in range(20000):
                t0 = clock()
                await a.write(mr, desc, 8)
                s.append(clock() - t0)
            s.sort()
            p50s.append(s[len(s) // 2] / 1e3)
        print(f"ALONE {prov} p50 us: " + " ".join(f"{x:.2f}" for x in p50s))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
