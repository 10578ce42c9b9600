"""Two processes, one write: the target registers memory and waits for an immediate; the
initiator writes 1 MiB into it with that immediate. Run: python examples/two_process.py [provider]
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection

import numpy as np

import afabric

N = 1 << 20


async def target(conn: Connection, provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        buf = np.zeros(N, dtype=np.uint8)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        conn.send((bytes(mr.descriptor), imm))  # any channel will do: the descriptor is bytes
        await eng.expect_imm(imm, 1)  # returns once the data is in place
        assert (buf == 42).all()
        print(f"target: {N} bytes arrived with immediate {imm}")


async def initiator(conn: Connection, provider: str) -> None:
    blob, imm = conn.recv()
    remote = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider) as eng:
        src = np.full(N, 42, dtype=np.uint8)
        mr = eng.register(src)
        await eng.write(mr, remote, N, imm=imm)
        print(f"initiator: wrote {N} bytes over {eng.provider} ({eng.fabric_provider})")


def run_target(conn: Connection, provider: str) -> None:
    asyncio.run(target(conn, provider))


def main() -> int:
    provider = sys.argv[1] if len(sys.argv) > 1 else "auto"
    ours, theirs = mp.Pipe()
    proc = mp.get_context("spawn").Process(target=run_target, args=(theirs, provider))
    proc.start()
    asyncio.run(initiator(ours, provider))
    proc.join(60)
    return proc.exitcode or 0


if __name__ == "__main__":
    sys.exit(main())
