"""Awaited 8 B reads one at a time from a target process (perop.py's): p50 / p99 µs over
rounds. Usage: readlat.py PROV [ROUNDS [READS]] (uvloop; A/B by running it with two builds)."""

import sys
from pathlib import Path

import numpy as np
import uvloop

from afabric import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent))  # -P leaves this directory out
from inline import ROUNDS, awaited
from perop import start_target

READS = int(sys.argv[3]) if len(sys.argv) > 3 else 3000


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    runs = []
    for _ in range(ROUNDS):
        async with Engine(prov) as eng:
            mr = eng.register(np.zeros(1 << 20, dtype=np.uint8))
            p50, p99 = await awaited(eng, mr, desc, READS, read=True)
            runs.append(f"{p50:.1f}/{p99:.1f}")
    print(f"read {prov} 8 B p50/p99 us: {' '.join(runs)}", flush=True)
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
