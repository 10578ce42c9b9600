"""Where 64 lanes of awaited writes wait, against one write_many of 64 at a time: the stage
stamps of every write (Engine(timing=True)), to a target process, two runs of each. Prints
GB/s, enqueue -> worker pickup, pickup -> first post and post -> completion (p50 / p90 µs),
and how many writes were in flight when each was posted.
Usage: timeline.py PROVIDER SIZE"""

import asyncio
import os
import sys
import time

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import start_target

from afabric import Engine

W, N = 64, 8000


def pct(xs: np.ndarray) -> str:
    return f"p50 {np.percentile(xs, 50) / 1e3:.1f} p90 {np.percentile(xs, 90) / 1e3:.1f}"


async def main(prov: str, size: int) -> None:
    a, p, desc = start_target(prov)
    eng = Engine(prov, timing=True)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))

    async def lane() -> None:
        for _ in range(N // W):
            await eng.write(mr, desc, size)

    async def batches() -> None:
        for _ in range(N // W):
            await eng.write_many(mr, desc, [size] * W)

    for _ in range(2):
        for mode in ("lanes", "write_many"):
            eng.timings()
            t0 = time.perf_counter()
            if mode == "lanes":
                await asyncio.gather(*(lane() for _ in range(W)))
            else:
                await batches()
            dt = time.perf_counter() - t0
            t = eng.timings()
            enq, pick = np.array([x.t_enqueue for x in t]), np.array([x.t_pickup for x in t])
            post, done = np.array([x.t_first_post for x in t]), np.array([x.t_complete for x in t])
            posts, dones = np.sort(post), np.sort(done)
            flight = np.searchsorted(posts, posts, side="right") - np.searchsorted(dones, posts, side="right")
            print(
                f"{mode} {prov} {size}: {N * size / dt / 1e9:.2f} GB/s, {len(t)} operations; enqueue->pickup "
                f"{pct(pick - enq)}, pickup->post {pct(post - pick)}, post->complete {pct(done - post)} µs; "
                f"in flight at post p50 {np.percentile(flight, 50):.0f}",
                flush=True,
            )
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], int(sys.argv[2])))
