"""The two-rail test bed (tests/netns.py): two network namespaces joined by two veth pairs.
libfabric's tcp provider sees one domain per rail, and a single-NIC engine per rail moves
data over that rail only, also when the rail is slowed down."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import afabric

from . import netns
from .netns import TwoRails
from .procs import Ctl, Peer

MiB = 1 << 20
QUIET_BYTES = 16 * 1024  # what an idle rail may carry meanwhile (ARP, nothing else: no IPv6)


@pytest.fixture
def rails() -> Iterator[TwoRails]:
    netns.require()
    with TwoRails() as tb:
        yield tb


def pattern(nbytes: int, seed: int) -> np.ndarray:
    words: np.ndarray = (np.arange(nbytes // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(
        seed
    )
    return words


def engine_kwargs(nic: str, addr: str) -> dict[str, Any]:
    """A single-NIC engine pinned to one rail: naming the NIC is enough (it binds that
    interface's address; `addr` is what it should get)."""
    del addr
    return {"nic": nic}


def group_kwargs(nics: list[str]) -> dict[str, Any]:
    """A multi-NIC engine over `nics`."""
    return {"nics": nics}


def sockaddr_in(addr: str) -> bytes:
    """An engine address (tcp) carries the sockaddr_in of the interface it bound."""
    return socket.inet_aton(addr)


# ---- child processes (module-level: pickled under spawn) ----


async def probe_nics(ctl: Ctl) -> dict[str, Any]:
    import afabric_ofi
    from afabric import _native

    cfg = _native.make_config(library=afabric_ofi.library_path(), provider_name="tcp", fabric_provider="tcp")
    name, nics = _native.probe(cfg)
    return {"name": name, "nics": [n.name for n in nics], "sys": sorted(os.listdir("/sys/class/net"))}


async def engine_address(ctl: Ctl, kw: dict[str, Any]) -> bytes | str:
    try:
        async with afabric.Engine("tcp", **kw) as eng:
            return bytes(eng.address)
    except afabric.errors.AfabricError as e:
        return f"{type(e).__name__}: {e}"


async def rail_target(ctl: Ctl, kw: dict[str, Any], nbytes: int, nchunks: int, seed: int) -> bytes:
    """Register `nbytes`, publish descriptor, immediate and address, wait for `nchunks`
    arrivals, verify every byte. Returns its address."""
    async with afabric.Engine("tcp", **kw) as eng:
        buf = np.zeros(nbytes // 8, dtype=np.uint64)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm, bytes(eng.address)))
        await eng.expect_imm(imm, nchunks, timeout=60)
        bad = np.flatnonzero(buf != pattern(nbytes, seed))
        assert bad.size == 0, f"{bad.size} words differ, first at word {bad[:5]}"
        return bytes(eng.address)


async def rail_initiator(
    ctl: Ctl, kw: dict[str, Any], desc_b: bytes, imm: int, nbytes: int, nchunks: int, seed: int
) -> tuple[bytes, float]:
    """Write `nbytes` to the target in `nchunks` writes, each with the immediate.
    Returns its address and the seconds the writes took."""
    async with afabric.Engine("tcp", **kw) as eng:
        src = pattern(nbytes, seed)
        mr = eng.register(src)
        desc = afabric.MrDesc.from_bytes(desc_b)
        chunk = nbytes // nchunks
        t0 = time.monotonic()
        await asyncio.gather(
            *(
                eng.write(mr, desc, chunk, src_offset=i * chunk, dst_offset=i * chunk, imm=imm)
                for i in range(nchunks)
            )
        )
        return bytes(eng.address), time.monotonic() - t0


async def group_target(ctl: Ctl, nics: list[str], nbytes: int, nwrites: int, seed: int) -> list[int]:
    """Like rail_target with a group of NICs; returns the immediates counted per NIC."""
    async with afabric.Engine("tcp", **group_kwargs(nics)) as eng:
        buf = np.zeros(nbytes // 8, dtype=np.uint64)
        mr = eng.register(buf)
        imm = eng.alloc_imm()
        ctl.put((bytes(mr.descriptor), imm, eng.nics))
        await eng.expect_imm(imm, nwrites, timeout=60)
        bad = np.flatnonzero(buf != pattern(nbytes, seed))
        assert bad.size == 0, f"{bad.size} words differ, first at word {bad[:5]}"
        return [int(n["imms"]) for n in eng.stats()["nics"]]


async def group_initiator(
    ctl: Ctl, nics: list[str], desc_b: bytes, imm: int, nbytes: int, nwrites: int, seed: int
) -> tuple[list[int], float]:
    """`nwrites` writes covering `nbytes`, all in flight at once (each sharded over the
    group's NICs). Returns bytes written per NIC and the seconds taken."""
    async with afabric.Engine("tcp", **group_kwargs(nics)) as eng:
        src = pattern(nbytes, seed)
        mr = eng.register(src)
        desc = afabric.MrDesc.from_bytes(desc_b)
        assert eng.nics == desc.nics == len(nics)
        n = nbytes // nwrites
        t0 = time.monotonic()
        await asyncio.gather(
            *(eng.write(mr, desc, n, src_offset=i * n, dst_offset=i * n, imm=imm) for i in range(nwrites))
        )
        seconds = time.monotonic() - t0
        return [int(s["write_bytes"]) for s in eng.stats()["nics"]], seconds


# ---- tests ----


def test_bed_is_built_and_torn_down_even_on_errors() -> None:
    netns.require()
    with pytest.raises(KeyError, match="boom"), TwoRails() as tb:
        names = netns._list_netns()
        assert tb.ns_a in names and tb.ns_b in names
        assert [tb.iface(r, s) for r in (0, 1) for s in ("a", "b")] == ["r0a", "r0b", "r1a", "r1b"]
        assert tb.addr(0, "a") == "192.0.2.1" and tb.addr(1, "b") == "198.51.100.2"
        assert tb.bytes(0) >= (0, 0)
        raise KeyError("boom")
    names = netns._list_netns()
    assert tb.ns_a not in names and tb.ns_b not in names


class _BadRails(TwoRails):
    rails = (*netns.RAILS, netns.Rail(2, "an-overlong-interface-name", "r2b", "203.0.113.1", "203.0.113.2"))


def test_failed_build_leaves_nothing() -> None:
    netns.require()
    tb = _BadRails()
    with pytest.raises(netns.NetnsError, match="an-overlong"):
        tb.build()
    names = netns._list_netns()
    assert tb.ns_a not in names and tb.ns_b not in names


async def test_children_see_only_their_namespace(rails: TwoRails, peers: list[Peer]) -> None:
    pa, pb = rails.peer("a", netns.interfaces), rails.peer("b", netns.interfaces)
    peers += [pa, pb]
    a, b = await pa.result(timeout=60), await pb.result(timeout=60)
    assert a == {"netlink": ["lo", "r0a", "r1a"], "sys": ["lo", "r0a", "r1a"]}, a
    assert b == {"netlink": ["lo", "r0b", "r1b"], "sys": ["lo", "r0b", "r1b"]}, b


async def test_tcp_lists_one_domain_per_rail(rails: TwoRails, peers: list[Peer]) -> None:
    p = rails.peer("a", probe_nics)
    peers.append(p)
    got = await p.result(timeout=60)
    assert {"r0a", "r1a"} <= set(got["nics"]), got
    # the child really is in ns A: nothing of the host's, nothing of ns B
    assert set(got["nics"]) <= {"lo", "r0a", "r1a"}, got


async def test_nic_alone_selects_the_rail(rails: TwoRails, peers: list[Peer]) -> None:
    """``Engine("tcp", nic="r0a")`` should bind r0a's address (FI_SOURCE)."""
    p = rails.peer("a", engine_address, {"nic": "r0a"})
    peers.append(p)
    got = await p.result(timeout=60)
    assert isinstance(got, bytes), got
    assert sockaddr_in("192.0.2.1") in got
    assert sockaddr_in("127.0.0.1") not in got


async def _write_over_rail(rails: TwoRails, peers: list[Peer], rail: int) -> float:
    """8 MiB from ns A to ns B over `rail`, checked end to end and on the byte counters.
    Returns the seconds the initiator's writes took."""
    nbytes, nchunks, seed = 8 * MiB, 8, 17 + rail
    other = 1 - rail
    before = {r: rails.bytes(r) for r in (0, 1)}
    kw_b = engine_kwargs(rails.iface(rail, "b"), rails.addr(rail, "b"))
    kw_a = engine_kwargs(rails.iface(rail, "a"), rails.addr(rail, "a"))
    target = rails.peer("b", rail_target, kw_b, nbytes, nchunks, seed)
    peers.append(target)
    desc_b, imm, target_addr = await target.get(timeout=60)
    assert sockaddr_in(rails.addr(rail, "b")) in target_addr
    initiator = rails.peer("a", rail_initiator, kw_a, desc_b, imm, nbytes, nchunks, seed)
    peers.append(initiator)
    init_addr, seconds = await initiator.result(timeout=90)
    assert sockaddr_in(rails.addr(rail, "a")) in init_addr
    assert await target.result(timeout=60) == target_addr
    after = {r: rails.bytes(r) for r in (0, 1)}
    tx = after[rail][0] - before[rail][0]
    assert tx >= nbytes, f"rail {rail} sent only {tx} bytes"
    quiet = sum(after[other]) - sum(before[other])
    assert quiet <= QUIET_BYTES, f"rail {other} carried {quiet} bytes"
    return float(seconds)


async def test_single_nic_engines_on_rail_0(rails: TwoRails, peers: list[Peer]) -> None:
    await _write_over_rail(rails, peers, 0)


async def test_single_nic_engines_on_slowed_rail_1(rails: TwoRails, peers: list[Peer]) -> None:
    rate_bps = 50e6
    shaping = rails.slow_rail(1, delay_ms=5, jitter_ms=1, rate="50mbit")
    assert shaping.startswith("netem" if netns.netem_available() else "tbf")
    seconds = await _write_over_rail(rails, peers, 1)
    # the shaping really applied: 8 MiB cannot cross a 50 Mbit/s rail much faster than this
    assert seconds >= 0.8 * 8 * MiB * 8 / rate_bps, f"{seconds:.2f} s: rail 1 was not slowed"


def test_stale_namespaces_of_dead_pids_are_removed() -> None:
    netns.require()
    dead = 1 << 23  # above the kernel's highest pid_max (2**22): never a live process
    name = f"afa-{dead}-{os.getpid()}"
    netns._run("ip", "netns", "add", name)
    try:
        assert name in netns.cleanup_stale()
        assert name not in netns._list_netns()
    finally:
        netns._delete_netns(name)


def test_enter_needs_no_threads_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("threading.active_count", lambda: 2)
    with pytest.raises(RuntimeError, match="before the process starts"):
        netns.enter("does-not-matter")


def test_unavailable_skips_or_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netns, "_probe", lambda: netns._Caps(False, "no netns here", False))
    assert netns.available() == (False, "no netns here")
    monkeypatch.delenv(netns.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="no netns here"):
        netns.require()
    monkeypatch.setenv(netns.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match="no netns here"):
        netns.require()


async def test_two_nic_group_over_both_rails_one_slowed(rails: TwoRails, peers: list[Peer]) -> None:
    """A two-NIC engine per side: every write is sharded over both rails, rail 1 is slow, so
    shards land heavily out of order; the bytes and the immediate counts must still be right,
    and each rail must have carried its share."""
    nbytes, nwrites, seed = 16 * MiB, 4, 23
    rails.slow_rail(1, delay_ms=5, jitter_ms=1, rate="200mbit")
    before = {r: rails.bytes(r) for r in (0, 1)}
    target = rails.peer("b", group_target, ["r0b", "r1b"], nbytes, nwrites, seed)
    peers.append(target)
    desc_b, imm, nics = await target.get(timeout=60)
    assert nics == 2
    initiator = rails.peer("a", group_initiator, ["r0a", "r1a"], desc_b, imm, nbytes, nwrites, seed)
    peers.append(initiator)
    per_nic, _seconds = await initiator.result(timeout=90)
    imms = await target.result(timeout=60)
    assert sum(imms) == nwrites, imms  # one arrival per write, however it was sharded
    assert sum(per_nic) >= nbytes and min(per_nic) >= nbytes // 4, per_nic
    for r in (0, 1):
        tx = rails.bytes(r)[0] - before[r][0]
        assert tx >= nbytes // 4, f"rail {r} sent only {tx} bytes"
