"""Where a triggered write's microseconds go: the bump of a watcher word (host memory, CPU
writer) -> the watcher thread saw it (``t_pickup`` of the fired operation, ``timing=True``)
-> its first work request posted. The bump comes from a thread (as `afabric bench trigger`'s
writer) or from the loop itself, 200-500 µs after the write was armed; p50 / p99 µs.
``thread`` starts a thread per bump, ``writer`` keeps one (as the bench does).
A bump is a plain store into the word, as `bench trigger`'s (a kernel's); with ``add`` as a
second argument word it is ``UvmWatcher.add(1)``, a ctypes call after the clock.
Usage: trigsplit.py PROV [thread|writer|loop] [add]"""

import asyncio
import ctypes
import multiprocessing as mp
import queue
import random
import statistics
import sys
import threading
import time

import numpy as np
from latsplit import target  # the same target process (this directory is on sys.path)

from afabric import Engine, MrDesc

N = 1000


ADD = "add" in sys.argv[3:]


def store(w) -> None:  # type: ignore[no-untyped-def]
    """One bump: the next value stored into the word (or ``add`` with ADD)."""
    if ADD:
        w.add(1)
    else:
        w.word[0] += 1


def bump(w, gap: float, out: list[int]) -> None:  # type: ignore[no-untyped-def]
    """The writer thread: sleep, note the time, bump."""
    time.sleep(gap)
    out.append(time.monotonic_ns())
    store(w)


def writer(w, jobs: "queue.SimpleQueue[float | None]", out: list[int]) -> None:  # type: ignore[no-untyped-def]
    """A long-lived writer thread: for each gap, sleep, note the time, bump."""
    while (gap := jobs.get()) is not None:
        bump(w, gap, out)


def pct(v: list[int], q: float) -> float:
    return sorted(v)[min(len(v) - 1, int(q * len(v)))] / 1e3


async def main(prov: str, mode: str) -> None:
    a, b = mp.get_context("spawn").Pipe()
    p = mp.get_context("spawn").Process(target=target, args=(b, prov, "adaptive"), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    rng = random.Random(1)
    async with Engine(prov, timing=True) as eng:
        mr = eng.register(np.ones(4096, dtype=np.uint8))
        w = eng.uvm_watcher()
        # the watcher outlives every bump
        w.word = np.ctypeslib.as_array((ctypes.c_uint64 * 1).from_address(w.host_ptr))
        bumps: list[int] = []
        jobs: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        stamps: list[int] = []
        wt = threading.Thread(target=writer, args=(w, jobs, stamps), daemon=True)
        if mode == "writer":
            wt.start()
        for k in range(1, N + 1):
            task = asyncio.ensure_future(eng.write(mr, desc, 64, when=w.reaches(k)))
            await asyncio.sleep(0)
            gap = rng.uniform(200e-6, 500e-6)
            if mode == "thread":
                out: list[int] = []
                th = threading.Thread(target=bump, args=(w, gap, out))
                th.start()
                await task
                th.join()
                bumps.append(out[0])
            elif mode == "writer":
                jobs.put(gap)
                await task
                bumps.append(stamps[-1])
            else:
                t_end = time.monotonic() + gap
                while time.monotonic() < t_end:
                    pass
                bumps.append(time.monotonic_ns())
                store(w)
                await task
        jobs.put(None)
        recs = [r for r in eng.timings() if r.kind == "write"]
        assert len(recs) == N, len(recs)
        seen = [r.t_pickup - t for r, t in zip(recs, bumps, strict=True)]
        post = [r.t_first_post - r.t_pickup for r in recs]
        total = [r.t_first_post - t for r, t in zip(recs, bumps, strict=True)]
        print(
            f"TRIG {prov} bump={mode} p50/p99 us: bump->seen {pct(seen, .5):.2f}/{pct(seen, .99):.2f} "
            f"seen->first post {pct(post, .5):.2f}/{pct(post, .99):.2f} total {pct(total, .5):.2f}/"
            f"{pct(total, .99):.2f} (mean {statistics.mean(total) / 1e3:.2f})",
            flush=True,
        )
        w.close()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "thread"))
