"""perop.py's 64 lanes with the loop's polling on (the engine's choice) and off (its poll
window set to 0: completions come through the event fd only), alternated four times: whether
the loop's looks at the ring inflate its CPU per write. Usage: pollcost.py PROVIDER"""

import sys

import numpy as np
import perop  # this directory is on sys.path (run as a script)
import uvloop

from afabric import Engine


async def main(prov: str) -> None:
    a, p, desc = perop.start_target(prov)
    eng = Engine(prov)
    mr = eng.register(np.ones(1 << 20, dtype=np.uint8))
    win = eng._poll_window
    await perop.lanes(eng, mr, desc, 20000, 64)
    res: dict[str, list[tuple[float, float]]] = {"poll": [], "nopoll": []}
    for _ in range(4):
        for mode in ("poll", "nopoll"):
            eng._poll_window = win if mode == "poll" else 0.0
            res[mode].append(await perop.lanes(eng, mr, desc, 60000, 64))
    for mode, v in res.items():
        print(mode, "wall/cpu us/op", " ".join(f"{w:.2f}/{c:.2f}" for w, c in sorted(v)), flush=True)
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
