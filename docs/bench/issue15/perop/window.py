"""How long a write awaited alone is looked for in the call that submits it
(afs_submit_take), in one process: awaited writes one at a time, p50 / p99 µs,
alternated over rounds against one target process: "slice" (5 µs, as before) and "spin"
(the default: up to spin_us, at most engine._TAKE_MAX_NS).
Usage: window.py PROV [ROUNDS [WRITES [LOOP [SIZE]]]] (SIZE bytes per write, default 8; the
writer's LOOP asyncio or uvloop, default uvloop: the loop `afabric bench` uses where it is
installed; the target is perop.py's)."""

import sys
from pathlib import Path

import numpy as np

from afabric import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # -P leaves this directory out
from inline import LOOP, ROUNDS, WRITES, awaited, runner
from perop import start_target

SIZE = int(sys.argv[5]) if len(sys.argv) > 5 else 8


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    modes = ["slice", "spin"]
    res: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    for r in range(ROUNDS):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            async with Engine(prov) as eng:
                if mode == "slice":
                    eng._take_ns = eng._poll_slice_ns
                mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
                res[mode].append(await awaited(eng, mr, desc, WRITES, SIZE))
    for mode, v in res.items():
        runs = " ".join(f"{x:.1f}/{y:.1f}" for x, y in v)
        print(f"window {prov} {LOOP} {SIZE} B {mode} p50/p99 us: {runs}", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    runner()(main(sys.argv[1]))
