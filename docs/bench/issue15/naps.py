"""How often a target's worker napped while awaited 8 B writes arrived one at a time: writer
and target engines in one process, default spin_us, 2,000 writes after 100 of warm-up, five
runs (each nap puts a wake-up on the next write's path). Usage: naps.py PROVIDER"""

import asyncio
import sys
import time

import numpy as np

from afabric import Engine


async def run(prov: str) -> tuple[int, float]:
    async with Engine(prov) as target, Engine(prov) as writer:
        desc = target.register(np.zeros(4096, np.uint8)).descriptor
        src = writer.register(np.zeros(4096, np.uint8))
        for _ in range(100):
            await writer.write(src, desc, 8)
        before, t0 = target.stats()["worker_naps"], time.perf_counter()
        for _ in range(2000):
            await writer.write(src, desc, 8)
        return target.stats()["worker_naps"] - before, (time.perf_counter() - t0) / 2000 * 1e6


def main(prov: str) -> None:
    runs = [asyncio.run(run(prov)) for _ in range(5)]
    print(f"NAPS {prov} per 2000 writes: " + " ".join(f"{n} ({us:.1f} us mean)" for n, us in runs))


if __name__ == "__main__":
    main(sys.argv[1])
