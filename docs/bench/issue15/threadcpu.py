"""Per-thread CPU while 64 coroutines await shm writes of one size into a target process
(writer: the loop's thread and the engine's worker; target: its worker), from /proc: which
thread, if any, bounds the rate, and how many writes each wake-up of the loop took.
Usage: threadcpu.py (4 KiB, then 64 KiB)"""

import asyncio
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent / "perop"))
from perop import start_target

from afabric import Engine


def thread_ticks(pid: int) -> dict[str, int]:
    """user + system clock ticks of each thread of pid, by "name:tid"."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        task = Path(f"/proc/{pid}/task/{tid}")
        try:
            fields = task.joinpath("stat").read_text().rsplit(")", 1)[1].split()
            out[f"{task.joinpath('comm').read_text().strip()}:{tid}"] = int(fields[11]) + int(fields[12])
        except OSError:
            continue
    return out


async def main(size: int, lanes: int, n: int) -> None:
    conn, proc, desc = start_target("shm")
    eng = Engine("shm")
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))

    async def lane(k: int) -> None:
        for _ in range(k):
            await eng.write(mr, desc, size)

    await asyncio.gather(*(lane(50) for _ in range(lanes)))
    w0, t0_ = thread_ticks(os.getpid()), thread_ticks(proc.pid)
    woken0 = eng.stats()["loop_woken"]
    t0 = time.perf_counter()
    await asyncio.gather(*(lane(n // lanes) for _ in range(lanes)))
    dt = time.perf_counter() - t0
    w1, t1_ = thread_ticks(os.getpid()), thread_ticks(proc.pid)
    woken = eng.stats()["loop_woken"] - woken0
    hz = os.sysconf("SC_CLK_TCK")
    print(
        f"size {size}: {n / dt:,.0f} writes/s, {n * size / dt / 1e9:.2f} GB/s over {dt:.2f} s; "
        f"the event fd woke the loop {woken:,} times ({n / max(woken, 1):.1f} writes each)"
    )
    for side, before, after in (("writer", w0, w1), ("target", t0_, t1_)):
        for k, ticks in after.items():
            share = (ticks - before.get(k, 0)) / hz / dt
            if share > 0.02:
                print(f"  {side} thread {k}: {share:.0%} of a core")
    conn.send(b"stop")
    eng.close()


if __name__ == "__main__":
    for size in (4096, 65536):
        asyncio.run(main(size, 64, 200000 if size == 4096 else 100000))
