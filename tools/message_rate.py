"""Small-message and write-with-immediate rates between two processes: N 8-byte messages
(SEND/RECV), then N 8-byte writes carrying one immediate value, each pipelined 256 at a time;
the target times its receives and its `expect_imm` for the N arrivals.

    python tools/message_rate.py shm [N]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import time
from multiprocessing.connection import Connection

import numpy as np

import afabric

BATCH = 256


def target(conn: Connection, provider: str, n: int) -> None:
    async def main() -> None:
        async with afabric.Engine(provider) as eng:
            mr = eng.register(np.zeros(4096, dtype=np.uint8))
            imm = eng.alloc_imm()
            conn.send((bytes(eng.address), bytes(mr.descriptor), imm))
            t0 = time.perf_counter()
            for _ in range(n):
                await eng.recv()
            t1 = time.perf_counter()
            await eng.expect_imm(imm, n, timeout=120)
            conn.send((t1 - t0, time.perf_counter() - t1))

    asyncio.run(main())


async def initiator(conn: Connection, provider: str, n: int) -> None:
    addr_b, desc_b, imm = conn.recv()
    addr, desc = afabric.Address.from_bytes(addr_b), afabric.MrDesc.from_bytes(desc_b)
    async with afabric.Engine(provider) as eng:
        src = eng.register(np.ones(64, dtype=np.uint8))
        for start in range(0, n, BATCH):
            await asyncio.gather(*(eng.send(addr, b"12345678") for _ in range(min(BATCH, n - start))))
        for start in range(0, n, BATCH):
            await asyncio.gather(*(eng.write(src, desc, 8, imm=imm) for _ in range(min(BATCH, n - start))))


def main() -> None:
    provider = sys.argv[1] if len(sys.argv) > 1 else "shm"
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 20_000
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=target, args=(theirs, provider, n))
    proc.start()
    asyncio.run(initiator(ours, provider, n))
    msg_s, imm_s = ours.recv()
    proc.join()
    print(f"{provider}: messages {n / msg_s:,.0f}/s, writes with an immediate {n / imm_s:,.0f}/s")


if __name__ == "__main__":
    main()
