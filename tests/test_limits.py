"""Resource bounds and process hygiene, between real processes over real providers.

- Loading a provider library keeps the application's signal dispositions (Debian's
  libfabric 1.17 pulls in libinfinipath, whose constructor installs its own SIGABRT, BUS,
  ILL, SEGV and TERM handlers).
- Descriptors: an engine raises the soft descriptor limit to the hard one; with every
  descriptor used up by idle connections it neither burns a core nor stops working.
- Messages nobody takes with recv() are bounded (max_queued_messages): beyond the bound
  the senders are held back (or, where the provider cannot do that safely, the overflow is
  dropped and counted); immediates of values nobody expects are bounded (max_imm_values):
  beyond it new values are dropped, counted and logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import afabric
from afabric import errors

from .faults import held
from .procs import Ctl, Peer

ROOT = Path(__file__).resolve().parent.parent


def run_child(code: str, cwd: Path, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (nothing loaded yet: the provider library's first load
    happens there), with the working directory `cwd`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


SIGTERM_CHILD = """
    import asyncio, os, signal, sys, time
    import numpy as np
    import afabric
    from afabric import registry

    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
    PROVIDER, HOW = sys.argv[1:3] if len(sys.argv) > 2 else ("{provider}", "{how}")

    async def main() -> None:
        if HOW == "info":  # what `afabric info` and provider="auto" do: probe every provider
            assert any(a.available for a in registry.probe_all())
            return
        async with afabric.Engine(PROVIDER) as a, afabric.Engine(PROVIDER) as b:
            buf = np.zeros(4096, dtype=np.uint8)
            mr = b.register(buf)
            imm = b.alloc_imm()
            src = a.register(np.full(4096, 7, dtype=np.uint8), remote=False)
            await a.write(src, mr.descriptor, 4096, imm=imm)
            await b.expect_imm(imm, 1)
            await a.send(b.address, b"x")
            assert await b.recv_bytes() == b"x"

    asyncio.run(main())
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    print("handled:", got)
    sys.exit(0 if got else 3)
"""


@pytest.mark.parametrize("how", ["engine", "info"])
def test_sigterm_handler_still_runs(provider: str, how: str, tmp_path: Path) -> None:
    """An application's Python SIGTERM handler runs after engines were opened and used (or
    after every provider was probed, as `afabric info` does), and nothing dropped a *.btr
    file into the working directory."""
    r = run_child(SIGTERM_CHILD.format(provider=provider, how=how), tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "handled: ['TERM']" in r.stdout
    assert not list(tmp_path.glob("*.btr")), r.stderr


ABORT_CHILD = """
    import asyncio, os, signal
    import afabric

    async def main() -> None:
        async with afabric.Engine("{provider}") as eng:
            eng.register(bytearray(4096))

    asyncio.run(main())
    for s in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGTERM):
        assert signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler), s
    print("ready", flush=True)
    os.abort()
"""


def test_default_dispositions_kept(provider: str, tmp_path: Path) -> None:
    """A process that never set handlers still dies of its own SIGABRT after using an
    engine (the default disposition: killed by the signal, no handler of the provider's
    writing a backtrace file into the working directory and exiting 1)."""
    r = run_child(ABORT_CHILD.format(provider=provider), tmp_path)
    assert "ready" in r.stdout, r.stderr
    assert r.returncode == -signal.SIGABRT, f"exit {r.returncode}\n{r.stderr}"
    assert not list(tmp_path.glob("*.btr")), [p.name for p in tmp_path.iterdir()]


# ---- bounded queues ----


async def message_flood(ctl: Ctl, provider: str, count: int, size: int) -> tuple[int, dict[str, int]]:
    """Sends `count` messages of `size` bytes at once to the address it is given; returns
    how many sends succeeded and the failures by error type. Its engine closes (and the
    process exits) before the target takes anything with recv()."""
    target = afabric.Address.from_bytes(await ctl.get())
    async with afabric.Engine(provider, op_timeout=3.0) as eng:
        payload = bytes(size)
        results = await asyncio.gather(
            *(eng.send(target, payload) for _ in range(count)), return_exceptions=True
        )
    failed: dict[str, int] = {}
    for r in results:
        if r is not None:
            failed[type(r).__name__] = failed.get(type(r).__name__, 0) + 1
    return sum(r is None for r in results), failed


async def test_unreceived_messages_bounded(provider: str, peers: list[Peer]) -> None:
    """2,000 x 64 KiB messages to an engine that does not recv(): it queues at most
    max_queued_messages (+ the receive buffers it withholds), its memory stays far below
    the 125 MiB they carry, and every message is accounted for: with back-pressure each
    send either failed with a typed error or its message is received later (after its
    sender has gone: on libfabric 1.17 tcp that crashed the process inside libfabric, so
    there the overflow is dropped and counted instead)."""
    # 64 KiB receive buffers, each message filling one with messages.py's header (a larger
    # message waits at its sender until the receiver has room: test_messages.py)
    n, size, bound, rx_depth = 2000, 65536 - 128, 64, 16
    async with afabric.Engine(provider, max_queued_messages=bound, rx_depth=rx_depth) as eng:
        before = held()
        sender = Peer(message_flood, provider, n, size)
        peers.append(sender)
        sender.put(bytes(eng.address))
        result = asyncio.ensure_future(sender.result(timeout=120))
        most = 0
        while not result.done():
            await asyncio.sleep(0.05)
            most = max(most, eng.stats()["messages_queued"])
        ok, failed = result.result()
        stats = eng.stats()
        after = held()
        received = 0
        with contextlib.suppress(asyncio.TimeoutError):
            while True:
                assert len(await asyncio.wait_for(eng.recv_bytes(), 5.0)) == size
                received += 1
        stats_end = eng.stats()
    grown = after.heap_mib - before.heap_mib
    print(
        f"\n{provider} ({eng.fabric_provider}, overflow {eng.queue_overflow}): "
        f"sends ok {ok}, failed {failed}; most queued {most}; received later {received}; "
        f"dropped {stats_end['messages_dropped']}; "
        f"malloc'd +{grown:.1f} MiB (the messages carry {n * size / 2**20:.0f} MiB)"
    )
    assert most <= bound + rx_depth and stats["messages_queued"] <= bound + rx_depth
    assert stats["messages_held_back"] > 0
    assert grown < n * size / 2**20 / 2, "received messages were all kept"
    if eng.queue_overflow == "backpressure":
        assert stats["backpressure"] and stats_end["messages_dropped"] == 0
        assert failed and set(failed) <= {"OperationTimeout"}, failed
        assert ok <= received <= n, "a send reported as delivered was lost"
    else:
        assert ok == n and not failed
        assert received + stats_end["messages_dropped"] == n, "a message was lost without being counted"
        assert stats_end["messages_dropped"] > 0


async def distinct_imms(ctl: Ctl, provider: str, first: int, count: int) -> int:
    """One 8-byte write per immediate value first .. first+count-1 to the region it is given."""
    blob = await ctl.get()
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider) as eng:
        src = eng.register(np.ones(8, dtype=np.uint8), remote=False)
        for start in range(first, first + count, 1000):
            batch = range(start, min(start + 1000, first + count))
            await asyncio.gather(*(eng.write(src, desc, 8, imm=v) for v in batch))
    return count


async def test_unexpected_immediates_bounded(
    provider: str, peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    """5,000 distinct immediates nobody expects, to an engine keeping at most 1,000 values:
    1,000 are kept (expect_imm for them returns at once), 4,000 dropped, counted in
    stats() and logged; expect_imm for a dropped one, with no timeout, fails at once with
    ImmediatesDropped naming the bound (before: it waited for ever). Said once: the value
    is free again afterwards."""
    n, bound, first = 5000, 1000, 1 << 20
    caplog.set_level(logging.WARNING, logger="afabric")
    async with afabric.Engine(provider, max_imm_values=bound) as eng:
        mr = eng.register(np.zeros(8, dtype=np.uint8))
        sender = Peer(distinct_imms, provider, first, n)
        peers.append(sender)
        sender.put(bytes(mr.descriptor))
        assert await sender.result(timeout=120) == n
        deadline = time.monotonic() + 30
        while True:
            nic = eng.stats()["nics"][0]
            if nic["imms"] >= n or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert nic["imms"] == n and nic["imms_dropped"] == n - bound, nic
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(eng.expect_imm(first + i, 1) for i in range(n)), return_exceptions=True), 60
        )
        kept = sum(o is None for o in outcomes)
        dropped = [o for o in outcomes if isinstance(o, errors.ImmediatesDropped)]
        assert (kept, len(dropped)) == (bound, n - bound), {type(o) for o in outcomes}
        assert "max_imm_values=1000" in str(dropped[0]) and "raise Engine(max_imm_values" in str(dropped[0])
        gone = next(first + i for i, o in enumerate(outcomes) if o is not None)
        with pytest.raises(errors.OperationTimeout):  # told once; the value is a fresh one now
            await eng.expect_imm(gone, 1, timeout=0.3)
        assert eng.stats()["max_imm_values"] == bound
    # the log carries the NOTICE record's `total`: how many were dropped so far
    logged = [int(m.split()[0]) for r in caplog.records if "of new values dropped" in (m := r.getMessage())]
    assert logged and 0 < max(logged) <= n - bound, logged


async def test_expectations_fail_past_the_exact_memory_of_drops(peers: list[Peer]) -> None:
    """More distinct values dropped than the engine remembers exactly (65,536 at a bound of
    one value): expectations on the ones past that still fail, as "may have been dropped",
    instead of waiting for ever."""
    n, first = 70_000, 1 << 22
    async with afabric.Engine("tcp", max_imm_values=1) as eng:
        mr = eng.register(np.zeros(8, dtype=np.uint8))
        sender = Peer(distinct_imms, "tcp", first, n)
        peers.append(sender)
        sender.put(bytes(mr.descriptor))
        assert await sender.result(timeout=120) == n
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if eng.stats()["nics"][0]["imms"] >= n:
                break
            await asyncio.sleep(0.05)
        assert eng.stats()["nics"][0]["imms_dropped"] == n - 1
        late = [first + n - 1 - i for i in range(20)]  # the last arrivals: past the exact set
        outcomes = await asyncio.wait_for(
            asyncio.gather(*(eng.expect_imm(v, 1) for v in late), return_exceptions=True), 30
        )
        assert all(isinstance(o, errors.ImmediatesDropped) for o in outcomes), outcomes
        assert all("may have been dropped" in str(o) for o in outcomes), outcomes[0]


def test_limits_validated() -> None:
    async def make(**kw: int) -> None:
        async with afabric.Engine("tcp", **kw):  # type: ignore[arg-type]
            pass

    for bad in ({"max_queued_messages": -1}, {"max_imm_values": 0}, {"max_imm_values": 1 << 30}):
        with pytest.raises(errors.InvalidArgument):
            asyncio.run(make(**bad))


# ---- descriptors ----

IDLE = 300  # idle connections opened to the target
IDLE_MANY = 1000  # ... where the limit allows
FD_SOFT = 256  # the target's soft descriptor limit (Debian's default is 1,024)


def tcp_port(address: bytes) -> int:
    """The listening port in a tcp engine's address (libfabric's sockaddr_in, loopback)."""
    m = re.search(rb"\x02\x00(..)\x7f\x00\x00\x01", address, re.S)
    assert m, "no IPv4 loopback sockaddr in the address"
    return int.from_bytes(m.group(1), "big")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def fd_limited_target(ctl: Ctl, soft: int, hard: int) -> None:
    """A tcp engine in a process with descriptor limits (soft, hard). Publishes (address,
    descriptor, pid, limits once the engine is open), then answers (imm, count) requests with
    the outcome of expect_imm(imm, count) until it gets None."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    async with afabric.Engine("tcp") as eng:
        mr = eng.register(np.zeros(64, dtype=np.uint8))
        ctl.put(
            (
                bytes(eng.address),
                bytes(mr.descriptor),
                os.getpid(),
                resource.getrlimit(resource.RLIMIT_NOFILE),
            )
        )
        while (req := await ctl.get(timeout=120)) is not None:
            try:
                await eng.expect_imm(req[0], req[1], timeout=30)
                ctl.put("ok")
            except errors.OperationTimeout:
                ctl.put("timeout")


async def new_peer(ctl: Ctl, blob: bytes, imm: int, writes: int) -> list[str]:
    """A new legitimate peer: `writes` 8-byte writes with `imm`, at once; their outcomes."""
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine("tcp", op_timeout=3.0) as eng:
        src = eng.register(np.ones(8, dtype=np.uint8), remote=False)
        res = await asyncio.gather(
            *(eng.write(src, desc, 8, imm=imm) for _ in range(writes)), return_exceptions=True
        )
    return ["ok" if r is None else type(r).__name__ for r in res]


async def idle_connections(port: int, count: int = IDLE) -> list[socket.socket]:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(count)]
    await asyncio.sleep(1.0)  # accepted (or not) by the target's provider
    return socks


async def test_idle_connections_leave_room_for_new_peers(peers: list[Peer]) -> None:
    """1,000 idle tcp connections to an engine whose process starts with a soft descriptor
    limit of 256: the engine raised it to the hard limit, so a new peer's writes all land,
    within its 3 s op_timeout (before: with 300 idle connections 8 of 8 failed, they held
    every descriptor; a worker napping through the connections' arrival delayed the first
    write by 8 s)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < FD_SOFT + 2 * IDLE_MANY:
        pytest.skip(f"hard descriptor limit {hard} too low for this test")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # this process's sockets (as an engine does)
    target = Peer(fd_limited_target, FD_SOFT, hard)
    peers.append(target)
    addr, blob, _pid, limits = await target.get()
    assert limits == (hard, hard), "the soft limit was not raised to the hard limit"
    socks = await idle_connections(tcp_port(addr), IDLE_MANY)
    try:
        target.put((1, 8))
        writer = Peer(new_peer, blob, 1, 8)
        peers.append(writer)
        assert await writer.result(timeout=60) == ["ok"] * 8
        assert await target.get() == "ok"
    finally:
        for s in socks:
            s.close()
    target.put(None)
    await target.result()


async def test_descriptor_exhaustion_survived(peers: list[Peer]) -> None:
    """With the hard limit itself at 256, 300 idle connections use up every descriptor.
    libfabric 1.17's tcp cannot accept a new peer then (its accept fails with EMFILE): the
    new peer's writes fail with typed errors within op_timeout. The target does not burn a
    core meanwhile (its listening socket stays readable: before, the worker woke on it
    without end, up to 100% of a core here), and once the idle connections close, a new
    peer's writes land."""
    target = Peer(fd_limited_target, FD_SOFT, FD_SOFT)
    peers.append(target)
    addr, blob, pid, limits = await target.get()
    assert limits == (FD_SOFT, FD_SOFT)
    socks = await idle_connections(tcp_port(addr))
    try:
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        await asyncio.sleep(3.0)
        share = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)
        writer = Peer(new_peer, blob, 1, 4)
        peers.append(writer)
        outcomes = await writer.result(timeout=60)
        print(f"\nexhausted: target CPU {share:.0%} while idle; new peer's writes: {outcomes}")
        assert share < 0.10, f"the target burns {share:.0%} of a core while its descriptors are used up"
        assert outcomes and set(outcomes) <= {"OperationTimeout", "PeerUnreachable"}, outcomes
    finally:
        for s in socks:
            s.close()
    target.put((2, 8))
    writer = Peer(new_peer, blob, 2, 8)
    peers.append(writer)
    assert await writer.result(timeout=60) == ["ok"] * 8
    assert await target.get() == "ok"
    target.put(None)
    await target.result()
