"""The awaited 8 B write taken apart, one at a time to a target process (20,000 each, two
rounds, p50 / p90 / mean): `await eng.write` whole; NativeEngine.take (the ctypes wrapper:
packing and one call); the bare ctypes call of afs_submit_take (the shim's submission, its
look and its take); an empty ctypes call (pending_wait(0)); and the raw C loop
(afs_bench_write_lat: submission to completion seen, the request built beforehand).
Usage: takesplit.py PROVIDER"""

import os
import sys
import time

import numpy as np
import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # run with python -P too
from perop import start_target

from afabric import Engine, _native

N = 20000


def pct(s: list[int]) -> str:
    s.sort()
    n = len(s)
    return f"p50 {s[n // 2] / 1e3:.2f} p90 {s[int(n * 0.9)] / 1e3:.2f} mean {sum(s) / n / 1e3:.2f}"


async def main(prov: str) -> None:
    a, p, desc = start_target(prov)
    async with Engine(prov) as eng:
        mr = eng.register(np.ones(4096, dtype=np.uint8))
        for _ in range(500):
            await eng.write(mr, desc, 8)
        clk = time.perf_counter_ns
        rid, peer = eng._remote(desc)
        mid = mr.check(eng)
        n = eng._n

        def settle(op: int, took: int) -> None:
            """One not taken completes through a drain, as Engine._alone's would."""
            if took != _native.TAKEN:
                eng._ops[op] = (eng._loop.create_future(), "write", peer, (mr,), "write")
                while op in eng._ops:
                    eng._process(poll=True)

        for _ in range(2):
            s = []
            for _ in range(N):
                t0 = clk()
                await eng.write(mr, desc, 8)
                s.append(clk() - t0)
            print("await write  ", pct(s))
            s = []
            for _ in range(N):
                t0 = clk()
                op, took = n.take("write", _native.OP_WRITE, mid, rid, 8, 0, 0, _native.NO_IMM, 50000)
                s.append(clk() - t0)
                settle(op, took)
            print("n.take       ", pct(s))
            s = []
            f, h, rp, out = n._submit_take_hot, n._h, n._req_p, n._out_p
            for _ in range(N):
                t0 = clk()
                took = f(h, rp, out, 50000)
                s.append(clk() - t0)
                settle(n._out.value, took)
            print("ctypes take  ", pct(s))
            s = []
            for _ in range(N):
                t0 = clk()
                n.pending_wait(0)
                s.append(clk() - t0)
            print("empty ctypes ", pct(s))
            print("raw C lat    ", pct(n.bench_write_lat(mid, rid, 8, N).tolist()))
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1]))
