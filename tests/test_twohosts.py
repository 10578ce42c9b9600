"""The two-host test bed (tests/hosts.py): host A's processes are one afabric host, host B's
(its own PID namespace) another; tcp connects the two over their veth pair, cma connects
only the processes of one host."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

import afabric

from . import hosts, netns
from .hosts import TwoHosts
from .procs import Ctl, Peer

MiB = 1 << 20
NBYTES = 1 * MiB
CHUNKS = 4


@pytest.fixture
def bed() -> Iterator[TwoHosts]:
    hosts.require()
    with TwoHosts() as tb:
        yield tb


def pattern(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def nspid(pid: int) -> list[int]:
    """The pids of `pid` in each PID namespace it is in, outermost first (/proc's NSpid)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("NSpid:"):
            return [int(p) for p in line.split()[1:]]
    raise AssertionError(f"no NSpid line for {pid}")


def only_child(p: Peer) -> int:
    """A B peer's process (the only child of the spawned process outside B)."""
    assert p.proc.pid is not None
    kids = hosts.children(p.proc.pid)
    assert len(kids) == 1, kids
    return kids[0]


# ---- child processes (module-level: pickled under spawn) ----


async def identity(ctl: Ctl, bind: str) -> None:
    """Publish what the kernel and an engine's address say of this process's host, then hold
    on until told (so the test can look at the process from outside)."""
    info = hosts.host_facts()
    async with afabric.Engine("tcp", bind=bind) as eng:
        addr = afabric.Address.from_bytes(bytes(eng.address))
        info.update(afabric_host=addr.host, afabric_pid=addr.pid, address=bytes(addr))
    ctl.put(info)
    await ctl.get(timeout=120)


async def wait_forever(ctl: Ctl) -> None:
    ctl.put(os.getpid())
    await ctl.get(timeout=600)


async def tcp_host_b(ctl: Ctl, bind: str, seed: int) -> str:
    """Host B's end: a registered buffer that host A fills, then a message each way."""
    async with afabric.Engine("tcp", bind=bind) as eng:
        buf = np.zeros(NBYTES, dtype=np.uint8)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm, bytes(eng.address)))
        await eng.expect_imm(imm, CHUNKS, timeout=60)
        bad = np.flatnonzero(buf != pattern(NBYTES, seed))
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:5]}"
        msg = await asyncio.wait_for(eng.recv(), 60)
        assert bytes(msg.data) == b"hello from A", msg.data
        await eng.send(msg.sender, b"hello from B")
        return str(msg.sender)


async def tcp_host_a(ctl: Ctl, bind: str, desc_b: bytes, imm: int, addr_b: bytes, seed: int) -> str:
    """Host A's end: write the pattern into B's buffer in CHUNKS writes, each with the
    immediate, send B a message and take B's answer."""
    async with afabric.Engine("tcp", bind=bind) as eng:
        src = pattern(NBYTES, seed)
        mr = eng.register(src)
        desc = afabric.MrDesc.from_bytes(desc_b)
        n = NBYTES // CHUNKS
        writes = (eng.write(mr, desc, n, src_offset=i * n, dst_offset=i * n, imm=imm) for i in range(CHUNKS))
        await asyncio.wait_for(asyncio.gather(*writes), 60)
        b = afabric.Address.from_bytes(addr_b)
        await eng.send(b, b"hello from A")
        reply = await asyncio.wait_for(eng.recv(), 60)
        assert bytes(reply.data) == b"hello from B", reply.data
        assert reply.sender == b
        return str(eng.address)


async def cma_target(ctl: Ctl, seed: int, expect_write: bool) -> None:
    """A cma engine's registered buffer; with `expect_write`, wait for the pattern to land
    in it (one immediate); then hold on until told."""
    async with afabric.Engine("cma") as eng:
        buf = np.zeros(NBYTES, dtype=np.uint8)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm))
        if expect_write:
            await eng.expect_imm(imm, 1, timeout=60)
            assert np.array_equal(buf, pattern(NBYTES, seed))
            ctl.put("landed")
        await ctl.get(timeout=120)


async def cma_writer(ctl: Ctl, seed: int, same_host: tuple[bytes, int], other_host: bytes) -> tuple[str, str]:
    """Write the pattern to a cma engine of this host, then try one on the other host.
    Returns the type and text of the error the second write raised ("" if it did not)."""
    async with afabric.Engine("cma") as eng:
        src = pattern(NBYTES, seed)
        mr = eng.register(src)
        desc, imm = same_host
        await asyncio.wait_for(eng.write(mr, afabric.MrDesc.from_bytes(desc), NBYTES, imm=imm), 60)
        try:
            await asyncio.wait_for(eng.write(mr, afabric.MrDesc.from_bytes(other_host), NBYTES), 60)
        except afabric.errors.AfabricError as e:
            return type(e).__name__, str(e)
        return "", ""


# ---- the bed itself ----


def test_bed_is_built_and_torn_down_even_on_errors() -> None:
    hosts.require()
    with pytest.raises(KeyError, match="boom"), TwoHosts() as tb:
        assert {tb.ns_a, tb.ns_b} <= set(netns._list_netns())
        assert (tb.host_addr("a"), tb.host_addr("b")) == ("192.0.2.1", "192.0.2.2")
        assert nspid(tb.init_pid)[1:] == [1]  # pid 1 of B's PID namespace
        assert (
            os.stat(f"/proc/{tb.init_pid}/ns/pid").st_ino == tb.pidns_b != os.stat("/proc/self/ns/pid").st_ino
        )
        raise KeyError("boom")
    assert not {tb.ns_a, tb.ns_b} & set(netns._list_netns())
    assert not Path(f"/proc/{tb.init_pid}").exists()


async def test_host_b_peers_die_with_their_parent_and_with_the_bed(peers: list[Peer]) -> None:
    """No B process outlives what started it: Peer.kill kills the peer in B itself; SIGKILL
    a B peer's parent (outside B) and the peer dies (parent-death signal); close the bed with
    a B peer running and it dies too."""
    hosts.require()
    with TwoHosts() as tb:
        killed, orphaned, running = (tb.peer("b", wait_forever) for _ in range(3))
        peers += [killed, orphaned, running]
        pids_b = [await p.get(timeout=60) for p in (killed, orphaned, running)]
        inner = [only_child(p) for p in (killed, orphaned, running)]
        assert [nspid(p)[-1] for p in inner] == pids_b
        fds = [os.pidfd_open(p) for p in inner]
        try:
            killed.kill()
            assert select.select([fds[0]], [], [], 0)[0] and not killed.proc.is_alive()
            assert orphaned.proc.pid is not None
            os.kill(orphaned.proc.pid, signal.SIGKILL)
            assert select.select([fds[1]], [], [], 30)[0], "a B peer outlived its parent"
            assert not select.select([fds[2]], [], [], 0)[0]
        finally:
            tb.close()
            try:
                # the bed waited for B's init to be reaped, which happens after all of B's
                assert select.select([fds[2]], [], [], 0)[0], "a B peer outlived the bed"
            finally:
                for fd in fds:
                    os.close(fd)


# ---- afabric on it ----


async def test_hosts_are_told_apart(bed: TwoHosts, peers: list[Peer]) -> None:
    """Two peers in A are one afabric host, the peer in B another (a different PID
    namespace, same boot id); B's peer has a small pid of its own namespace."""
    a1 = bed.peer("a", identity, bed.host_addr("a"))
    a2 = bed.peer("a", identity, bed.host_addr("a"))
    b = bed.peer("b", identity, bed.host_addr("b"))
    peers += [a1, a2, b]
    i1, i2, ib = [await p.get(timeout=60) for p in (a1, a2, b)]
    # the kernel's view: A's two share the test's PID namespace and A's network namespace
    mine = os.stat("/proc/self/ns/pid").st_ino
    assert i1["pidns"] == i2["pidns"] == mine != ib["pidns"] == bed.pidns_b
    assert i1["netns"] == i2["netns"] != ib["netns"]
    assert i1["boot_id"] == i2["boot_id"] == ib["boot_id"]
    assert i1["interfaces"] == ["lo", "r0a"] and ib["interfaces"] == ["lo", "r0b"]
    assert (i1["pid"], i2["pid"]) == (a1.proc.pid, a2.proc.pid)
    # B's peer: pid 2 or more in B (1 is B's init), and /proc is B's
    inner = only_child(b)
    assert nspid(inner) == [inner, ib["pid"]] and 1 < ib["pid"] < inner
    assert ib["proc_self"] == str(ib["pid"])
    # afabric's view: the host ids its addresses carry (shim/procfs.c)
    assert (i1["afabric_pid"], i2["afabric_pid"], ib["afabric_pid"]) == (i1["pid"], i2["pid"], ib["pid"])
    assert i1["afabric_host"] == i2["afabric_host"] != ib["afabric_host"]
    assert None not in (i1["afabric_host"], ib["afabric_host"])
    assert socket.inet_aton("192.0.2.1") in i1["address"] and socket.inet_aton("192.0.2.2") in ib["address"]
    for p in (a1, a2, b):
        p.put("done")
        await p.result(timeout=60)


async def test_tcp_between_hosts(bed: TwoHosts, peers: list[Peer]) -> None:
    """tcp bound to A's veth address writes 1 MiB into B's registered buffer (checked at
    B), then a message each way; the bytes crossed the veth pair."""
    seed = 5
    tx_before = bed.bytes(0)[0]
    b = bed.peer("b", tcp_host_b, bed.host_addr("b"), seed)
    peers.append(b)
    desc_b, imm, addr_b = await b.get(timeout=60)
    a = bed.peer("a", tcp_host_a, bed.host_addr("a"), desc_b, imm, addr_b, seed)
    peers.append(a)
    addr_a = await a.result(timeout=120)
    assert await b.result(timeout=60) == addr_a  # B answered the engine in A
    assert bed.bytes(0)[0] - tx_before >= NBYTES


async def test_cma_within_a_host_only(bed: TwoHosts, peers: list[Peer]) -> None:
    """cma between two processes of A writes (bytes checked at the target); to a process of
    B it fails at once with PeerUnreachable (B is another PID namespace), not a hang."""
    seed = 9
    target_a = bed.peer("a", cma_target, seed, True)
    target_b = bed.peer("b", cma_target, seed, False)
    peers += [target_a, target_b]
    same_host = await target_a.get(timeout=60)
    desc_b, _ = await target_b.get(timeout=60)
    writer = bed.peer("a", cma_writer, seed, same_host, desc_b)
    peers.append(writer)
    kind, text = await writer.result(timeout=120)
    assert await target_a.get(timeout=60) == "landed"
    assert kind == "PeerUnreachable", (kind, text)
    assert "another PID namespace" in text and "[cma]" in text, text
    for p in (target_a, target_b):
        p.put("done")
        await p.result(timeout=60)
