"""An idle engine's CPU: one engine, 3 s of nothing, the process's CPU time in % of a core.
Usage: python tools/idle_cpu.py PROVIDER"""

import asyncio
import sys
import time

from afabric import Engine


async def main(prov: str) -> None:
    async with Engine(prov):
        await asyncio.sleep(0.5)
        c0, t0 = time.process_time(), time.monotonic()
        await asyncio.sleep(3)
        cpu = 100 * (time.process_time() - c0) / (time.monotonic() - t0)
        print(f"IDLE {prov} cpu%={cpu:.2f}", flush=True)


asyncio.run(main(sys.argv[1]))
