"""How the loop takes 64 lanes' completions: 64 coroutines each awaiting 8 B writes to a
target process (as perop.py), counting drains, the records each drain found, looks
(pending_wait) and the engine's loop_woken / loop_polled, three runs of 60,000 writes.
Usage: batches.py PROVIDER"""

import os
import sys
from typing import Any

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import lanes, start_target

from afabric import Engine


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    eng = Engine(prov)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
    n = eng._n
    cnt = {"drain": 0, "got": 0, "empty": 0, "look": 0}
    drain0, look0 = n.drain, n.pending_wait

    def drain(room: Any = None, plain: list[int] | None = None, poll: bool = False) -> Any:
        cnt["drain"] += 1
        before = len(plain) if plain is not None else 0
        events = drain0(room, plain, poll)
        got = (len(plain) - before if plain is not None else 0) + len(events)
        cnt["got"] += got
        cnt["empty"] += got == 0
        return events

    def look(max_ns: int) -> int:
        cnt["look"] += 1
        return look0(max_ns)

    n.drain, n.pending_wait = drain, look
    await lanes(eng, mr, desc, 20000, 64)
    for _ in range(3):
        cnt.update(drain=0, got=0, empty=0, look=0)
        s0 = eng.stats()
        wall, cpu = await lanes(eng, mr, desc, 60000, 64)
        s1 = eng.stats()
        found = max(1, cnt["drain"] - cnt["empty"])
        print(
            f"{prov} wall {wall:.2f} cpu {cpu:.2f} drains {cnt['drain']} empty {cnt['empty']} "
            f"per-drain {cnt['got'] / found:.1f} pending_waits {cnt['look']} "
            f"woken {s1['loop_woken'] - s0['loop_woken']} polled {s1['loop_polled'] - s0['loop_polled']}",
            flush=True,
        )
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
