"""Where an awaited 8 B write's microseconds go: the shim's stage stamps (``timing=True``)
between the Python call and the coroutine's resumption, one write at a time, medians.
Usage: latsplit.py PROV [POLLING [LOOP]] (the target polls as the writer does; LOOP asyncio
(default) or uvloop, the loop `afabric bench` uses where it is installed)."""

import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from typing import Any

import numpy as np

from afabric import Engine, MrDesc

N = 4000
LOOP = sys.argv[3] if len(sys.argv) > 3 else "asyncio"


def target(conn: Any, prov: str, polling: str) -> None:
    async def run() -> None:
        async with Engine(prov, polling=polling) as eng:
            mr = eng.register(np.zeros(1 << 20, dtype=np.uint8))
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(run())


async def main(prov: str, polling: str) -> None:
    a, b = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=target, args=(b, prov, polling), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    async with Engine(prov, polling=polling, timing=True) as eng:
        mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
        for _ in range(500):
            await eng.write(mr, desc, 8)
        eng.timings()
        calls, resumes = [], []
        for _ in range(N):
            t0 = time.monotonic_ns()
            await eng.write(mr, desc, 8)
            resumes.append(time.monotonic_ns())
            calls.append(t0)
        recs = eng.timings()
        assert len(recs) == N, len(recs)
        cols: dict[str, list[int]] = {"call->enqueue": [], "queued": [], "pickup->post": [], "in_flight": [],
                                      "complete->resume": [], "total": []}
        for t0, t1, r in zip(calls, resumes, recs, strict=True):
            cols["call->enqueue"].append(r.t_enqueue - t0)
            cols["queued"].append(r.t_pickup - r.t_enqueue)
            cols["pickup->post"].append(r.t_first_post - r.t_pickup)
            cols["in_flight"].append(r.t_complete - r.t_last_post)
            cols["complete->resume"].append(t1 - r.t_complete)
            cols["total"].append(t1 - t0)
        parts = " ".join(f"{k}={statistics.median(v) / 1e3:.2f}" for k, v in cols.items())
        print(f"SPLIT {prov} {polling} {LOOP} p50 us: {parts}", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    run = asyncio.run
    if LOOP == "uvloop":
        import uvloop

        run = uvloop.run
    run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "adaptive"))
