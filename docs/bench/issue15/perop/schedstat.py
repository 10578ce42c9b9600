"""Which thread waits, and for what, while 64 coroutines await writes of one size into a
target process: each thread's run time and run-queue wait (/proc/<pid>/task/<tid>/schedstat)
as shares of the run's wall time, and its voluntary / involuntary context switches; with the
writer engine's worker naps and event-fd wake-ups of the loop.
Usage: schedstat.py PROVIDER SIZE [asyncio|uvloop]
Environment: N (writes, default 100,000); WPOLL / TPOLL (the writer's / target's polling,
adaptive or spin); WSPIN (the writer's spin_us); TCPU=c (the target process pinned to CPU c,
the writer to CPU 1-c)."""

import asyncio
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import uvloop

from afabric import Engine, MrDesc


def target(conn: Any, prov: str, polling: str) -> None:
    async def run() -> None:
        async with Engine(prov, polling=polling) as eng:
            mr = eng.register(np.ones(1 << 20, dtype=np.uint8), remote="rw")
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    uvloop.run(run())


def start_target(prov: str) -> tuple[Any, Any, MrDesc]:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov, os.environ.get("TPOLL", "adaptive")), daemon=True)
    p.start()
    return a, p, MrDesc.from_bytes(a.recv())


def snap(pid: int) -> dict[str, tuple[int, ...]]:
    """(run ns, run-queue wait ns, voluntary, involuntary switches) of each thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        t = Path(f"/proc/{pid}/task/{tid}")
        try:
            run, wait, _ = (int(x) for x in t.joinpath("schedstat").read_text().split())
            st = dict(line.split(":", 1) for line in t.joinpath("status").read_text().splitlines())
            out[tid] = (run, wait, int(st["voluntary_ctxt_switches"]), int(st["nonvoluntary_ctxt_switches"]))
        except (OSError, KeyError, ValueError):
            continue
    return out


def pin(proc: Any, cpu: int) -> None:
    for tid in os.listdir(f"/proc/{proc.pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})
    os.sched_setaffinity(0, {1 - cpu})


async def main(prov: str, size: int, lanes: int, n: int) -> None:
    conn, proc, desc = start_target(prov)
    if "TCPU" in os.environ:
        pin(proc, int(os.environ["TCPU"]))
    extra = {"spin_us": int(os.environ["WSPIN"])} if "WSPIN" in os.environ else {}
    eng = Engine(prov, polling=os.environ.get("WPOLL", "adaptive"), **extra)  # type: ignore[arg-type]
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))

    async def lane(k: int) -> None:
        for _ in range(k):
            await eng.write(mr, desc, size)

    await asyncio.gather(*(lane(50) for _ in range(lanes)))
    a0, b0, s0 = snap(os.getpid()), snap(proc.pid), eng.stats()
    t0 = time.perf_counter()
    await asyncio.gather(*(lane(n // lanes) for _ in range(lanes)))
    dt = time.perf_counter() - t0
    a1, b1, s1 = snap(os.getpid()), snap(proc.pid), eng.stats()
    print(
        f"{prov} size {size}: {n * size / dt / 1e9:.2f} GB/s {n / dt:,.0f}/s; "
        f"woken {s1['loop_woken'] - s0['loop_woken']}, naps {s1['worker_naps'] - s0['worker_naps']}"
    )
    for side, x0, x1 in (("writer", a0, a1), ("target", b0, b1)):
        for k, v in x1.items():
            if k not in x0:
                continue
            d = [v[i] - x0[k][i] for i in range(4)]
            if d[0] / 1e9 / dt > 0.02:
                run, wait = d[0] / 1e9 / dt, d[1] / 1e9 / dt
                print(f"  {side} {k}: run {run:.0%} wait {wait:.0%} vol {d[2]} invol {d[3]}")
    conn.send(b"stop")
    eng.close()


if __name__ == "__main__":
    run = uvloop.run if sys.argv[3:4] == ["uvloop"] else asyncio.run
    run(main(sys.argv[1], int(sys.argv[2]), 64, int(os.environ.get("N", "100000"))))
