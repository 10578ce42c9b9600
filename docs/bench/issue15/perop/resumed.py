"""How many of 64 lanes' awaited 8 B writes go through the path of a write awaited alone
(Engine._alone: submitted and looked for in one call, holding the loop until found or
_TAKE_MAX_NS), beside the wall and loop-thread CPU time per write; three runs of 60,000.
Usage: resumed.py PROVIDER"""

import collections
import os
import sys
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import lanes, start_target

from afabric import Engine
from afabric import engine as engine_mod

COUNT: collections.Counter[str] = collections.Counter()


def counting(real: Any) -> Any:
    def alone(self: Engine, *a: Any) -> Any:
        fut = real(self, *a)
        COUNT["alone"] += 1
        COUNT["taken" if fut is None else "future"] += 1
        return fut

    return alone


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    eng = Engine(prov)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
    await lanes(eng, mr, desc, 20000, 64)
    for _ in range(3):
        COUNT.clear()
        wall, cpu = await lanes(eng, mr, desc, 60000, 64)
        print(f"RESUMED {prov} wall {wall:.2f} cpu {cpu:.2f} us/op; of 60000 writes alone "
              f"{COUNT['alone']} (taken {COUNT['taken']})", flush=True)  # fmt: skip
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    engine_mod.Engine._alone = counting(engine_mod.Engine._alone)  # type: ignore[method-assign]
    uvloop.run(main(sys.argv[1]))
