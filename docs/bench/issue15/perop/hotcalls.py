"""The loop thread's per-operation calls, timed alone: a drain that finds one completion,
an empty drain (the shim's ring through ctypes), best and median of 3000 each, for the
provider given; the write submit is `python -m afabric.bench.submit`. Works with the
trees before and after the hot calls took prebuilt addresses (drain(None, plain, poll)).
Usage: hotcalls.py PROVIDER"""

import asyncio
import statistics
import sys
import time

import numpy as np

from afabric import Engine


async def main(prov: str) -> None:
    async with Engine(prov, spin_us=0) as a, Engine(prov, spin_us=0) as b:
        mr = a.register(np.ones(4096, dtype=np.uint8))
        desc = b.register(np.zeros(4096, dtype=np.uint8)).descriptor
        await a.write(mr, desc, 8)  # resolves the peer, imports the descriptor
        n, rid, no_imm = a._n, desc._rid[1], -1
        one, empty = [], []
        clock = time.perf_counter_ns
        for _ in range(3000):
            op = n.write("write", mr.id, rid, 8, 0, 0, no_imm)
            while not n._pending(n._h):
                pass
            plain: list[int] = []
            t0 = clock()
            n.drain(None, plain, True)
            t1 = clock()
            n.drain(None, plain, True)
            t2 = clock()
            assert plain == [op], (plain, op)
            one.append(t1 - t0)
            empty.append(t2 - t1)
        n.drain(None, [], False)
        for name, v in (("drain of one", one), ("empty drain", empty)):
            print(f"HOT {prov} {name}: best {min(v) / 1e3:.2f} median {statistics.median(v) / 1e3:.2f} us")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
