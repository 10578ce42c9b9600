"""The loop's look with and without its slice (afs_pending_wait), in one process: awaited
8 B writes one at a time, 3000 per row, the slice set to 0 and to the default alternately,
three rounds; p50 and p99 µs. Usage: slice.py PROVIDER (run from the repository root)."""

import multiprocessing as mp
import sys
import time

import numpy as np
import uvloop

sys.path.insert(0, "docs/bench/issue15")
from latsplit import target

from afabric import Engine, MrDesc, engine


async def main(prov: str) -> None:
    a, b = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=target, args=(b, prov, "adaptive"), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    async with Engine(prov) as eng:
        mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
        for _ in range(500):
            await eng.write(mr, desc, 8)
        for _ in range(3):
            for slice_ns in (0, engine._POLL_SLICE_NS):
                eng._poll_slice_ns = slice_ns
                lat = []
                for _ in range(3000):
                    t0 = time.perf_counter_ns()
                    await eng.write(mr, desc, 8)
                    lat.append(time.perf_counter_ns() - t0)
                lat.sort()
                p50, p99 = lat[1500] / 1e3, lat[2970] / 1e3
                print(f"SLICE {prov} {slice_ns:5d} ns: p50 {p50:.2f} p99 {p99:.2f} us", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
