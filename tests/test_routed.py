"""The default engine routes: ``Engine()`` holds cma and tcp here and takes, per peer, the
fastest transport that reaches it (cma to a process of this host, tcp otherwise), with one
counter, one identity and one address whichever transport carried what. Real processes
throughout; the two-host cases (a second network and PID namespace) are in
test_routed_hosts.py."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os

import numpy as np
import pytest

import afabric
from afabric import errors
from afabric.triggers import imm_count

from .procs import Ctl, Peer

REGION = 1 << 20
PAGE = 4096
PR_SET_DUMPABLE = 4


def _undumpable() -> None:
    """This process refuses cross-memory attach from then on (prctl(PR_SET_DUMPABLE, 0))."""
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0, os.strerror(ctypes.get_errno())


async def target(ctl: Ctl, provider: str, undumpable: bool = False, bind: str | None = None) -> str:
    """A peer with a 1 MiB region (the bytes i % 251) that answers commands."""
    async with afabric.Engine(provider, bind=bind) as eng:
        if undumpable:
            _undumpable()
        buf = np.zeros(REGION, dtype=np.uint8)
        mr = eng.register(buf, remote="rw")
        ctl.put((bytes(mr.descriptor), bytes(eng.address), eng.transports))
        while (cmd := await ctl.get()) != "stop":
            if cmd == "fill":
                buf[:] = np.arange(REGION, dtype=np.uint64) % 251
                ctl.put("filled")
            elif cmd == "zero":
                buf[:] = 0
                ctl.put("zeroed")
            elif cmd == "bytes":
                ctl.put(bytes(buf))
            elif cmd[0] == "expect":
                await eng.expect_imm(cmd[1], cmd[2], timeout=30)
                ctl.put("counted")
            elif cmd == "echo":
                msg = await eng.recv(tag=5)
                await eng.send(msg.sender, bytes(msg.data)[::-1], tag=6)
                ctl.put(eng.route(msg.sender))
            elif cmd == "dereg":
                eng.deregister(mr)
                ctl.put("gone")
        return "stopped"


def _pattern() -> np.ndarray:
    return (np.arange(REGION, dtype=np.uint64) % 251).astype(np.uint8)


async def _start(
    peers: list[Peer], provider: str = "auto", **kw: bool
) -> tuple[Peer, afabric.MrDesc, afabric.Address]:
    p = Peer(target, provider, *kw.values())
    peers.append(p)
    desc_b, addr_b, _ = await p.get()
    return p, afabric.MrDesc.from_bytes(desc_b), afabric.Address.from_bytes(addr_b)


async def _peer_bytes(p: Peer) -> np.ndarray:
    p.put("bytes")
    return np.frombuffer(await p.get(), dtype=np.uint8)


async def test_default_engine_opens_cma_and_tcp_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="afabric")
    async with afabric.Engine() as eng:
        assert eng.provider == "auto"
        assert eng.transports == ("cma", "tcp")
        assert eng.address.transports == ("cma", "tcp")
        assert "auto opened cma" in eng.provider_choice and "tcp for any host" in eng.provider_choice
        assert [n["transport"] for n in eng.stats()["nics"]] == ["cma", "tcp"]
    assert any("auto opened cma" in r.getMessage() for r in caplog.records)


async def test_every_operation_to_a_same_host_peer_goes_over_cma(  # noqa: PLR0915
    peers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
    """write, write_many, write_paged, scatter, barrier, read, read_paged, gather, immediates,
    a triggered write and send/recv with a reply to msg.sender: all over cma, bytes checked,
    nothing on tcp; the route is logged once."""
    caplog.set_level(logging.INFO, logger="afabric")
    b, desc, addr = await _start(peers)
    pat = _pattern()
    async with afabric.Engine(op_timeout=20) as eng:
        assert eng.route(addr) == "cma"
        src = pat.copy()
        mr = eng.register(src)
        # write with an immediate: counted once at B
        imm = 11
        b.put(("expect", imm, 1))
        await eng.write(mr, desc, REGION, imm=imm)
        assert await b.get() == "counted"
        assert np.array_equal(await _peer_bytes(b), pat)
        # write_many, write_paged, scatter: each writes a part back over a zeroed region
        b.put("zero")
        await b.get()
        await eng.write_many(
            mr, desc, [PAGE] * 4, [0, PAGE, 2 * PAGE, 3 * PAGE], [0, PAGE, 2 * PAGE, 3 * PAGE]
        )
        idx = np.arange(4, 8, dtype=np.int64)
        await eng.write_paged(
            mr, desc, page_len=PAGE, src_pages=afabric.Pages(idx, PAGE), dst_pages=afabric.Pages(idx, PAGE)
        )
        await eng.scatter(mr, [afabric.ScatterTarget(desc, PAGE, 8 * PAGE, 8 * PAGE)])
        await eng.barrier([desc], 12)
        got = await _peer_bytes(b)
        assert np.array_equal(got[: 9 * PAGE], pat[: 9 * PAGE])
        assert not got[9 * PAGE :].any()
        # a write triggered by an immediate count of this engine's own
        trig = eng.alloc_imm()
        fired = eng.write(mr, desc, PAGE, 9 * PAGE, 9 * PAGE, when=imm_count(trig, 1))
        task = asyncio.ensure_future(fired)
        await asyncio.sleep(0.05)
        assert not task.done()
        self_mr_buf = np.zeros(PAGE, dtype=np.uint8)
        self_mr = eng.register(self_mr_buf)
        await eng.write(mr, self_mr.descriptor, 8, imm=trig)  # to itself: the count
        await asyncio.wait_for(task, 20)
        assert np.array_equal((await _peer_bytes(b))[9 * PAGE : 10 * PAGE], pat[9 * PAGE : 10 * PAGE])
        # reads back from B
        b.put("fill")
        await b.get()
        dst = np.zeros(REGION, dtype=np.uint8)
        dmr = eng.register(dst)
        await eng.read(dmr, desc, REGION)
        assert np.array_equal(dst, pat)
        dst[:] = 0
        await eng.read_paged(
            dmr, desc, page_len=PAGE, src_pages=afabric.Pages(idx, PAGE), dst_pages=afabric.Pages(idx, PAGE)
        )
        await eng.gather(dmr, [afabric.GatherSource(desc, PAGE, 0, 0)])
        assert np.array_equal(dst[:PAGE], pat[:PAGE])
        assert np.array_equal(dst[4 * PAGE : 8 * PAGE], pat[4 * PAGE : 8 * PAGE])
        # messages, and the reply to msg.sender
        b.put("echo")
        await eng.send(addr, b"abcdef", tag=5)
        reply = await eng.recv(tag=6)
        assert bytes(reply.data) == b"fedcba" and reply.sender == addr
        assert await b.get() == "cma"
        nics = {n["transport"]: n for n in eng.stats()["nics"]}
        assert nics["cma"]["writes"] > 0 and nics["cma"]["reads"] > 0 and nics["cma"]["sends"] >= 1
        assert nics["tcp"]["writes"] == nics["tcp"]["reads"] == nics["tcp"]["sends"] == 0
        b.put("stop")
        assert await b.result() == "stopped"
    told = [
        r.getMessage()
        for r in caplog.records
        if "route to" in r.getMessage() and repr(addr) in r.getMessage()
    ]
    assert len(told) == 1 and told[0].endswith(": cma"), told


@pytest.mark.parametrize("single", ["tcp", "cma"])
async def test_routed_and_single_provider_engines_interoperate(single: str, peers: list[Peer]) -> None:
    """A default engine reaches an Engine("tcp") over tcp and an Engine("cma") over cma, and
    the single-provider engine imports the routed one's descriptors (AFD3) and addresses."""
    b, desc, addr = await _start(peers, single)
    pat = _pattern()
    async with afabric.Engine() as eng:
        assert eng.route(addr) == single
        mr = eng.register(pat.copy())
        await eng.write(mr, desc, REGION)
        assert np.array_equal(await _peer_bytes(b), pat)
        b.put("echo")
        await eng.send(addr, b"xy", tag=5)
        assert bytes((await eng.recv(tag=6)).data) == b"yx"
        assert await b.get() == single
        b.put("stop")
        await b.result()


def _drop_ptrace_capability() -> None:
    """This process loses CAP_SYS_PTRACE (as a process of an ordinary user has not got it):
    the kernel's checks for cross-memory attach then apply to it (root skips them)."""

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [
            ("effective", ctypes.c_uint32),
            ("permitted", ctypes.c_uint32),
            ("inheritable", ctypes.c_uint32),
        ]

    libc = ctypes.CDLL(None, use_errno=True)
    hdr, data = Header(0x20080522, 0), (Data * 2)()
    assert libc.capget(ctypes.byref(hdr), data) == 0, os.strerror(ctypes.get_errno())
    cap_sys_ptrace = 19
    data[0].effective &= ~(1 << cap_sys_ptrace)
    data[0].permitted &= ~(1 << cap_sys_ptrace)
    assert libc.capset(ctypes.byref(hdr), data) == 0, os.strerror(ctypes.get_errno())


async def initiator_without_ptrace(ctl: Ctl, desc_b: bytes, addr_b: bytes) -> tuple[str, list[str], bool]:
    """A default engine in a process without CAP_SYS_PTRACE: its route to the peer, the
    route lines it logged, and whether its write landed over that route."""
    _drop_ptrace_capability()
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("afabric").addHandler(Keep())
    logging.getLogger("afabric").setLevel(logging.INFO)
    desc, addr = afabric.MrDesc.from_bytes(desc_b), afabric.Address.from_bytes(addr_b)
    async with afabric.Engine() as eng:
        route = eng.route(addr)
        mr = eng.register(_pattern())
        await eng.write(mr, desc, REGION)
        nics = {n["transport"]: n["writes"] for n in eng.stats()["nics"]}
    return route, [ln for ln in lines if "route to" in ln], nics["cma"] == 0 and nics["tcp"] > 0


async def test_a_peer_that_refuses_cma_is_reached_over_tcp_and_the_log_says_why(peers: list[Peer]) -> None:
    """A peer that turned non-dumpable after opening its engine (its address still lists
    cma), and an initiator the kernel's ptrace rules apply to: the resolve finds that
    cross-memory attach into the peer is refused, takes tcp, and says so once."""
    b, desc, addr = await _start(peers, "auto", undumpable=True)
    assert addr.transports == ("cma", "tcp")
    a = Peer(initiator_without_ptrace, bytes(desc), bytes(addr))
    peers.append(a)
    route, told, over_tcp = await a.result()
    assert route == "tcp" and over_tcp
    assert len(told) == 1, told
    assert ": tcp (cma: cross-memory attach into process" in told[0] and "EPERM" in told[0], told
    assert np.array_equal(await _peer_bytes(b), _pattern())
    b.put("stop")
    await b.result()


async def test_deregister_fences_the_routed_path(peers: list[Peer]) -> None:
    b, desc, _ = await _start(peers)
    async with afabric.Engine() as eng:
        mr = eng.register(np.ones(REGION, dtype=np.uint8))
        await eng.write(mr, desc, PAGE)
        b.put("dereg")
        assert await b.get() == "gone"
        with pytest.raises(errors.TransportError):
            await eng.write(mr, desc, PAGE)
        b.put("stop")
        await b.result()


async def test_a_killed_peer_is_reported_down_once_and_its_descriptors_refused(peers: list[Peer]) -> None:
    b, desc, addr = await _start(peers)
    async with afabric.Engine(op_timeout=10) as eng:
        mr = eng.register(np.ones(REGION, dtype=np.uint8))
        events = eng.peer_events()
        await eng.write(mr, desc, PAGE)
        up = await asyncio.wait_for(events.__anext__(), 10)
        assert up.address == addr and up.kind == "up"
        b.kill()
        down = await asyncio.wait_for(events.__anext__(), 10)
        assert down.address == addr and down.kind == "down"
        with pytest.raises(errors.PeerUnreachable):
            await eng.write(mr, desc, PAGE)
        with pytest.raises(asyncio.TimeoutError):  # one peer, one identity: reported once
            await asyncio.wait_for(events.__anext__(), 1.0)
        # a new process at this host gets a fresh route
        c, desc_c, addr_c = await _start(peers)
        assert eng.route(addr_c) == "cma"
        await eng.write(mr, desc_c, PAGE)
        c.put("stop")
        await c.result()


async def test_cuda_memory_route_is_refused_with_a_reason_without_a_gpu(peers: list[Peer]) -> None:
    """No nvlink here (no GPU): route(device=0) names why nothing carries CUDA memory."""
    _, _, addr = await _start(peers)
    async with afabric.Engine() as eng:
        with pytest.raises(errors.AfabricError, match="CUDA memory needs a transport"):
            eng.route(addr, device=0)
