"""The inline first look on and off in one process: awaited 8 B writes one at a time, p50 /
p99 µs, alternated over rounds against one target process, three ways: "off" (_INLINE_RUN 0:
every await waits on the loop, as before), "look" (the write submitted, then looked for and
drained from Python, as _look_inline does for other operations), "take" (the default: one
call submits and takes the completion, afs_submit_take).
Usage: inline.py PROV [ROUNDS [WRITES [LOOP]]] (the writer's LOOP asyncio or uvloop, default
uvloop: the loop `afabric bench` uses where it is installed; the target is perop.py's)."""

import asyncio
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import numpy as np

import afabric.engine as engine_mod
from afabric import Engine, MrDesc, _native

sys.path.insert(0, str(Path(__file__).resolve().parent))  # -P leaves this directory out
from perop import start_target  # the target process: a registered 1 MiB region

ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 3
WRITES = int(sys.argv[3]) if len(sys.argv) > 3 else 3000
LOOP = sys.argv[4] if len(sys.argv) > 4 else "uvloop"


def runner() -> Callable[[Coroutine[Any, Any, None]], None]:
    if LOOP == "uvloop":
        import uvloop

        return uvloop.run
    return asyncio.run


def look_only(eng: Engine) -> None:
    """take as submit, then afs_pending_wait: a record found is drained in Python."""
    n = eng._n

    def take(what: str, code: int, *a: int) -> tuple[int, int]:
        op = n.write(what, *a[:-1])
        return op, (_native.TAKE_OTHER if a[-1] >= 0 and n.pending_wait(a[-1]) else _native.TAKE_NONE)

    n.take = take  # type: ignore[method-assign]


async def awaited(
    eng: Engine, mr: Any, desc: MrDesc, n: int, size: int = 8, read: bool = False
) -> tuple[float, float]:
    """n awaited writes (or reads) of ``size`` bytes one at a time, after 300 unmeasured:
    p50 and p99 µs."""
    op = eng.read if read else eng.write
    for _ in range(300):
        await op(mr, desc, size)
    xs = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        await op(mr, desc, size)
        xs.append(time.perf_counter_ns() - t0)
    xs.sort()
    return xs[len(xs) // 2] / 1e3, xs[int(len(xs) * 0.99)] / 1e3


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    modes = ["off", "look", "take"]
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(ROUNDS):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            engine_mod._INLINE_RUN = 0 if mode == "off" else 8  # read by each new Engine
            async with Engine(prov) as eng:
                if mode == "look":
                    look_only(eng)
                mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
                res[mode].append(await awaited(eng, mr, desc, WRITES))
    for mode, v in res.items():
        runs = " ".join(f"{x:.1f}/{y:.1f}" for x, y in v)
        print(f"inline {prov} {LOOP} {mode} p50/p99 us: {runs}", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    runner()(main(sys.argv[1]))
