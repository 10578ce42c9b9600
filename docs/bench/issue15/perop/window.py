"""How long a write awaited alone is looked for in the call that submits it
(afs_submit_take), in one process: awaited writes one at a time, p50 / p99 µs,
alternated over rounds against one target process: "slice" (5 µs, as before) and "spin"
(the default: up to spin_us, at most engine._TAKE_MAX_NS).
Usage: window.py PROV [ROUNDS [WRITES [LOOP [SIZE]]]] (SIZE bytes per write, default 8; the
writer's LOOP asyncio or uvloop, default uvloop: the loop `afabric bench` uses where it is
installed; the target is perop.py's)."""

import asyncio
import multiprocessing as mp
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

from afabric import Engine, MrDesc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # -P leaves this directory out
from perop import target  # the target process: a registered 1 MiB region

ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
WRITES = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
LOOP = sys.argv[4] if len(sys.argv) > 4 else "uvloop"
SIZE = int(sys.argv[5]) if len(sys.argv) > 5 else 8


def runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    if LOOP == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


async def awaited(eng: Engine, mr: Any, desc: MrDesc) -> tuple[float, float]:
    for _ in range(300):
        await eng.write(mr, desc, SIZE)
    xs = []
    for _ in range(WRITES):
        t0 = time.perf_counter_ns()
        await eng.write(mr, desc, SIZE)
        xs.append(time.perf_counter_ns() - t0)
    xs.sort()
    return xs[len(xs) // 2] / 1e3, xs[int(len(xs) * 0.99)] / 1e3


async def main(prov: str) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    modes = ["slice", "spin"]
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(ROUNDS):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            async with Engine(prov) as eng:
                if mode == "slice":
                    eng._take_ns = eng._poll_slice_ns
                mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
                res[mode].append(await awaited(eng, mr, desc))
    for mode, v in res.items():
        runs = " ".join(f"{x:.1f}/{y:.1f}" for x, y in v)
        print(f"window {prov} {LOOP} {SIZE} B {mode} p50/p99 us: {runs}", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    runner()(main(sys.argv[1]))
