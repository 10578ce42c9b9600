"""`afabric bench soak`: hours of mixed traffic to several peer processes, watching what the
initiator holds. Paged writes, scatters, barriers and SEND/RECV round trips run in rounds;
every target checks every byte and counts every immediate. A line every ``--every``
seconds shows operations, threads, file descriptors and resident memory; at the end the
run fails (exit 1) if an operation failed, a check failed, or threads or descriptors grew.
Resident memory is reported, not judged: freed memory stays cached in malloc's per-thread
arenas, so it climbs for a while and then levels off (compare the middle and the end)."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import cast

import numpy as np

from ..address import Address
from ..descriptor import MrDesc
from ..engine import Engine
from ..groups import PeerGroup, ScatterTarget
from ..memory import MemoryRegion
from ..pages import Pages
from . import harness, loops

HELP = "mixed traffic to several peers for N minutes; threads, fds and memory must stay flat"
PAGE = 256
PAGES = 1024  # per target region
STALL_S = 60.0  # a round not done by then is reported with both sides' counters
ARRIVALS = 4 * 256 + 8 + 1  # immediates per peer per round: pages, scatter targets, barrier
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    p.add_argument("--provider", default="auto", type=harness.provider_name, help=harness.PROVIDER_HELP)
    p.add_argument("--peers", type=harness.positive_int, default=3, help="target processes (default 3)")
    p.add_argument("--every", type=float, default=10.0, help="seconds between progress lines")
    p.add_argument("--json", metavar="PATH", help=harness.JSON_HELP)
    p.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default=harness.default_loop(), help=harness.LOOP_HELP
    )


@dataclass
class Sample:
    seconds: float
    operations: int
    writes: int
    threads: int
    fds: int
    rss_mib: float


def _sample(t0: float, ops: int, writes: int) -> Sample:
    rss = int(Path("/proc/self/statm").read_text().split()[1]) * _PAGE_SIZE / (1 << 20)
    threads = len(os.listdir("/proc/self/task")) - threading.active_count()
    return Sample(time.monotonic() - t0, ops, writes, threads, len(os.listdir("/proc/self/fd")), rss)


def _pattern(nbytes: int, seed: int) -> np.ndarray:
    words = (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed)
    out: np.ndarray = words.view(np.uint8)
    return out


def _target(conn: Connection, provider: str) -> None:
    """A peer: each round it publishes an immediate, waits for the arrivals it is told to
    expect, checks that every written byte is right and answers the round's messages."""

    async def run() -> None:
        async with Engine(provider, rx_depth=1024) as eng:
            buf = np.zeros(PAGES * PAGE, dtype=np.uint8)
            mr = eng.register(buf)
            want = _pattern(PAGES * PAGE, 9)
            conn.send((bytes(mr.descriptor), bytes(eng.address)))
            loop = asyncio.get_running_loop()
            while True:
                imm = eng.alloc_imm()
                conn.send(imm)
                msg = await loop.run_in_executor(None, conn.recv)
                if msg is None:
                    return
                arrivals, messages = msg
                where = f"{arrivals} arrivals"
                try:
                    await eng.expect_imm(imm, arrivals, timeout=STALL_S)
                    for k in range(messages):
                        where = f"message {k + 1} of {messages}"
                        body = await asyncio.wait_for(eng.recv_bytes(), STALL_S)
                        reply_to = Address.from_bytes(body[:-8])
                        await eng.send(reply_to, body[-8:])
                except Exception as e:
                    print(f"soak peer {os.getpid()}: stalled waiting for {where} "
                          f"({type(e).__name__}): {eng.stats()}", file=sys.stderr, flush=True)  # fmt: skip
                    raise
                written = buf != 0
                bad = int(np.count_nonzero(buf[written] != want[written]))
                buf[:] = 0
                conn.send(bad)

    loops.run(run(), "asyncio")  # a stopping signal cancels it (bench.interrupt)


async def _round(
    eng: Engine,
    src: MemoryRegion,
    group: PeerGroup,
    descs: list[MrDesc],
    addrs: list[Address],
    pipes: list[Connection],
    get: Callable[[Connection], Awaitable[object]],
    rng: np.random.Generator,
) -> tuple[int, int, int, int]:
    """One round to every peer: 4 paged writes of 256 pages, a scatter of 8 pages and a
    barrier (each with the peer's immediate), 4 SEND/RECV round trips. Returns (failed
    operations, bad bytes the peers found, operations, write work requests)."""
    imms = [int(str(await get(c))) for c in pipes]
    work: list[Awaitable[None]] = []
    for k, (desc, imm) in enumerate(zip(descs, imms, strict=True)):
        for _ in range(4):
            pages = Pages(rng.choice(PAGES, 256, replace=False).astype(np.int64), PAGE)
            work.append(eng.write_paged(src, desc, page_len=PAGE, src_pages=pages, dst_pages=pages, imm=imm))
        off = int(rng.integers(0, PAGES - 8)) * PAGE
        targets = [ScatterTarget(desc, PAGE, off + j * PAGE, off + j * PAGE) for j in range(8)]
        work.append(eng.scatter(src, targets, imm=imm))
        work.append(eng.barrier([desc], imm, group=group))
        pipes[k].send((ARRIVALS, 4))
    for a in addrs:
        work += [eng.send(a, bytes(eng.address) + os.urandom(8)) for _ in range(4)]
    results = await asyncio.gather(*work, return_exceptions=True)
    failures = sum(1 for r in results if isinstance(r, BaseException))
    for k in range(4 * len(addrs)):
        try:
            await asyncio.wait_for(eng.recv_bytes(), STALL_S)
        except TimeoutError:
            raise TimeoutError(f"reply {k + 1} of {4 * len(addrs)} never came: {eng.stats()}") from None
    bad = sum([int(str(await get(c))) for c in pipes])
    return failures, bad, len(work) + 4 * len(addrs), len(addrs) * ARRIVALS


async def _soak(args: argparse.Namespace) -> dict[str, object]:
    children = [
        harness.Child(f"soak peer process {k}", _target, (harness.PIPE, args.provider))
        for k in range(args.peers)
    ]
    try:
        async with harness.watch(*children):  # a peer that dies fails the run at once
            return await _soak_with(args, children)
    finally:
        for c in children:
            if not c.stopping:
                c.stop(None)
        for c in children:
            await asyncio.get_running_loop().run_in_executor(None, c.close, 30.0)


async def _soak_with(args: argparse.Namespace, children: list[harness.Child]) -> dict[str, object]:
    pipes = [c.conn for c in children]
    by_conn = {id(c.conn): c for c in children}

    async def get(c: Connection) -> object:
        try:
            return await by_conn[id(c)].arecv(120)
        except harness.ChildFailed as e:
            raise TimeoutError(f"a peer stopped answering: {e}") from None

    offers = [cast("tuple[bytes, bytes]", await get(c)) for c in pipes]
    descs = [MrDesc.from_bytes(d) for d, _ in offers]
    addrs = [Address.from_bytes(a) for _, a in offers]
    rng = np.random.default_rng(1)
    samples: list[Sample] = []
    failures = bad_bytes = ops = writes = 0
    t0 = time.monotonic()
    before = _sample(t0, 0, 0)
    print(f"before the engine: threads {before.threads}, fds {before.fds}, RSS {before.rss_mib:.1f} MiB")
    async with Engine(args.provider, tx_depth=1024) as eng:
        group = eng.peer_group(addrs)
        src = eng.register(_pattern(PAGES * PAGE, 9).copy())
        next_line = args.every
        while time.monotonic() - t0 < args.minutes * 60:
            counts = await _round(eng, src, group, descs, addrs, pipes, get, rng)
            failures, bad_bytes = failures + counts[0], bad_bytes + counts[1]
            ops, writes = ops + counts[2], writes + counts[3]
            if time.monotonic() - t0 >= next_line:
                s = _sample(t0, ops, writes)
                samples.append(s)
                print(
                    f"{s.seconds:7.0f} s  {s.operations:>10} ops  {s.writes:>11} writes  "
                    f"{s.writes / s.seconds / 1e3:6.0f} k writes/s  threads {s.threads}  fds {s.fds}  "
                    f"RSS {s.rss_mib:.1f} MiB  failures {failures}  bad bytes {bad_bytes}",
                    flush=True,
                )
                next_line += args.every
        for child in children:
            await get(child.conn)  # the next round's immediate
            child.stop(None)
    for child in children:
        await asyncio.get_running_loop().run_in_executor(None, child.proc.join, 30)
    after = _sample(t0, ops, writes)
    first, last = (samples[0], samples[-1]) if samples else (after, after)
    flat = last.threads <= first.threads and last.fds <= first.fds
    flat = flat and after.threads <= before.threads and after.fds <= before.fds
    print(f"first sample: threads {first.threads}, fds {first.fds}, RSS {first.rss_mib:.1f} MiB\n"
          f"last sample:  threads {last.threads}, fds {last.fds}, RSS {last.rss_mib:.1f} MiB\n"
          f"closed: threads {after.threads}, fds {after.fds}, RSS {after.rss_mib:.1f} MiB")  # fmt: skip
    ok = flat and failures == 0 and bad_bytes == 0
    print(f"{'OK' if ok else 'FAILED'}: {ops} operations, {writes} writes, {failures} failed, "
          f"{bad_bytes} bad bytes, threads/fds {'flat' if flat else 'GREW'}")  # fmt: skip
    samples = [before, *samples, after]
    return {"ok": ok, "failures": failures, "bad_bytes": bad_bytes, "samples": [asdict(s) for s in samples]}


def main(args: argparse.Namespace) -> int:
    if args.peers < 1 or args.minutes <= 0:
        raise harness.CommandError("--peers must be >= 1 and --minutes > 0")
    args.provider, why = harness.resolve_provider(getattr(args, "provider", None))
    print(f"afabric bench soak — provider {args.provider}, loop {args.loop}, {args.peers} peers\n{why}")
    result = loops.run(_soak(args), args.loop)
    harness.write_json(result, args)
    return 0 if result["ok"] else 1
