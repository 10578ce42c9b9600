"""Device bench: afabric raw C loop and Python lanes, against one buffer (as fi_rma_bw does:
every write to offset 0) and across a 128 MiB span (as `afabric bench p2p` does), plus the
awaited 8 B write latency. Usage: pbench.py PROV POLLING SIZES REGIONS [lat]
(the target polls as $TPOLL says when set, else as POLLING; $WSPIN and $TSPIN set the
writer's and the target's spin_us, default 50)."""

import asyncio
import multiprocessing as mp
import os
import sys
import time
from typing import Any

import numpy as np

from afabric import Engine, MrDesc
from afabric.bench.raw import RawLoop

REGION = 128 << 20


def target(conn: Any, prov: str, polling: str) -> None:
    async def run() -> None:
        async with Engine(prov, polling=polling, spin_us=int(os.environ.get("TSPIN", "50"))) as eng:
            buf = np.ones(REGION, dtype=np.uint8)
            mr = eng.register(buf)
            conn.send(bytes(mr.descriptor))
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)

    asyncio.run(run())


async def py_lanes(eng: Any, mr: Any, desc: Any, size: int, lanes: int, iters: int, span: int) -> float:
    per = max(1, iters // lanes)

    async def lane(k: int) -> None:
        for i in range(per):
            off = ((k * per + i) % span) * size
            await eng.write(mr, desc, size, src_offset=off, dst_offset=off)

    t0 = time.perf_counter()
    await asyncio.gather(*(lane(k) for k in range(lanes)))
    return size * per * lanes / (time.perf_counter() - t0) / 1e9


async def main(prov: str, polling: str, sizes: list[int], regions: list[str], lat: bool) -> None:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=target, args=(b, prov, os.environ.get("TPOLL", polling)), daemon=True)
    p.start()
    desc = MrDesc.from_bytes(a.recv())
    eng = Engine(prov, polling=polling, spin_us=int(os.environ.get("WSPIN", "50")))
    src = np.ones(REGION, dtype=np.uint8)
    big = eng.register(src)
    for size in sizes:
        lanes = 64 if size <= 65536 else 16
        iters = max(200, min(20000, (1 << 30) // size))
        for region in regions:
            mr = eng.register(src[:size]) if region == "one" else big
            span = 1 if region == "one" else REGION // size
            loop = RawLoop(eng, mr, desc)
            loop.write(size, lanes, max(64, iters // 8))
            raw = sorted(size * iters / loop.write(size, lanes, iters) for _ in range(3))[1]
            pyi = min(iters, 20000)
            py = sorted([await py_lanes(eng, mr, desc, size, lanes, pyi, span) for _ in range(3)])[1]
            who = f"{polling}(spin_us={os.environ.get('WSPIN', '50')})/{os.environ.get('TPOLL', polling)}"
            row = f"ROW {prov} {who} {size} {region} W={lanes}"
            print(f"{row} raw_GBps={raw:.2f} py_GBps={py:.2f}", flush=True)
            if mr is not big:
                eng.deregister(mr)
    if lat:
        for _ in range(500):
            await eng.write(big, desc, 8)
        s = []
        for _ in range(5000):
            t0 = time.perf_counter_ns()
            await eng.write(big, desc, 8)
            s.append(time.perf_counter_ns() - t0)
        s.sort()
        raw = RawLoop(eng, big, desc).write(8, 1, 5000) / 5000
        print(
            f"LAT {prov} {polling} 8B py_p50_us={s[2500] / 1e3:.1f} py_p99_us={s[4950] / 1e3:.1f} "
            f"raw_mean_us={raw / 1e3:.1f}",
            flush=True,
        )
    await eng.aclose()
    a.send("x")
    p.join(10)


if __name__ == "__main__":
    asyncio.run(
        main(
            sys.argv[1],
            sys.argv[2],
            [int(x) for x in sys.argv[3].split(",")],
            sys.argv[4].split(","),
            len(sys.argv) > 5,
        )
    )
