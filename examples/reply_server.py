"""A server that answers each client by the sender of its message: no address inside the
requests, two tags on one engine, and a reply larger than any receive buffer.

    python examples/reply_server.py [tcp|shm]

The server takes requests on tag 1 (``b"square <n>"``) and answers each to ``msg.sender``
on tag 1; on tag 2 it sends every client an 8 MiB table, which the client receives into
its own registered memory with ``recv_into``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
from multiprocessing.connection import Connection

import numpy as np

import afabric

CLIENTS = 4
REQUESTS = 3
TABLE = 8 << 20
REQUEST, BULK = 1, 2  # application tags


async def serve(conn: Connection, provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        for _ in range(CLIENTS):
            conn.send(bytes(eng.address))
        table = np.arange(TABLE, dtype=np.uint8)  # wraps at 256
        greeted: set[afabric.Address] = set()
        for _ in range(CLIENTS * REQUESTS):
            msg = await eng.recv(tag=REQUEST)  # any client; msg.sender says which
            n = int(bytes(msg.data).split()[1])
            await eng.send(msg.sender, b"%d" % (n * n), tag=REQUEST)
            if msg.sender not in greeted:
                greeted.add(msg.sender)
                await eng.send(msg.sender, table.data, tag=BULK)  # fragments: any size
        st = eng.stats()  # afabric.EngineStats: typed keys
        assert st["messages_forged"] == 0 and st["bytes_reserved"] == 0
        print(f"server: answered {CLIENTS * REQUESTS} requests from {len(greeted)} clients")


async def ask(server_blob: bytes, provider: str, k: int) -> None:
    server = afabric.Address.from_bytes(server_blob)
    async with afabric.Engine(provider) as eng:
        out = np.zeros(TABLE, dtype=np.uint8)
        mr = eng.register(out)
        bulk = asyncio.ensure_future(eng.recv_into(mr, tag=BULK))  # waits beside the requests
        for i in range(REQUESTS):
            n = 10 * k + i
            await eng.send(server, b"square %d" % n, tag=REQUEST)
            reply = await eng.recv(tag=REQUEST)
            assert reply.sender == server and int(bytes(reply.data)) == n * n
        got = await bulk
        assert len(got.data) == TABLE and (out == np.arange(TABLE, dtype=np.uint8)).all()
        print(f"client {k}: {REQUESTS} answers and the {TABLE >> 20} MiB table")


def client(server_blob: bytes, provider: str, k: int) -> None:
    asyncio.run(ask(server_blob, provider, k))


def main() -> None:
    provider = sys.argv[1] if len(sys.argv) > 1 else "tcp"
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    srv = ctx.Process(target=server, args=(there, provider))
    srv.start()
    blobs = [here.recv() for _ in range(CLIENTS)]
    procs = [ctx.Process(target=client, args=(blobs[k], provider, k)) for k in range(CLIENTS)]
    for p in procs:
        p.start()
    for p in [*procs, srv]:
        p.join(120)
        if p.exitcode != 0:
            raise SystemExit(f"a process failed (exit {p.exitcode})")


def server(conn: Connection, provider: str) -> None:
    asyncio.run(serve(conn, provider))


if __name__ == "__main__":
    main()
