"""Who may write where, between real processes: local-only regions and forged descriptors,
revocation by deregistration, loopback binding, and bounded message sizes. Where a provider
reports a refused access (tcp) the initiator must see a TransportError; on every provider
the target's memory must be untouched."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
import zlib

import numpy as np
import pytest

import afabric
from afabric import errors

from .conftest import WITH_CMA, WITH_ROUTED, libfabric_version
from .procs import Ctl, Peer


@pytest.fixture(params=WITH_ROUTED)
def provider(request: pytest.FixtureRequest) -> str:
    """These tests run on the default engine too, which routes (cma here, tcp elsewhere)."""
    return str(request.param)


OP_TIMEOUT = 2.0
N = 1 << 16


def reseal(body: bytes) -> bytes:
    """A blob with a valid checksum (what a forger would make)."""
    return body + struct.pack("<I", zlib.crc32(body))


def forge_descriptor(blob: bytes, *, length: int | None = None) -> bytes:
    """The descriptor with another region length, the key untouched."""
    body = blob[:-4]
    addr_len = struct.unpack_from("<I", body, 4)[0]
    at = 8 + addr_len
    base, old_len, device, nics = struct.unpack_from("<QQiI", body, at)
    new = struct.pack("<QQiI", base, old_len if length is None else length, device, nics)
    return reseal(body[:at] + new + body[at + len(new) :])


def address_without_limit(blob: bytes) -> bytes:
    """The address as an engine that does not announce its message limit would send it."""
    body = bytearray(blob[:-4])
    body[6:8] = b"\0\0"
    return reseal(bytes(body))


async def guarded_target(ctl: Ctl, provider: str) -> bool:
    """Registers a remote region and, right after it in memory, a local-only one; answers
    "bytes changed?" for both, and deregisters the remote one on request."""
    async with afabric.Engine(provider) as eng:
        mem = np.zeros(3 * N, dtype=np.uint8)
        remote, local = mem[:N], mem[2 * N :]
        mr = eng.register(remote)
        eng.register(local, remote=False)
        ctl.put((bytes(mr.descriptor), local.ctypes.data - remote.ctypes.data))
        while (cmd := await ctl.get()) != "stop":
            if cmd == "deregister":
                eng.deregister(mr)
                remote[:] = 0
                ctl.put("revoked")
            elif cmd == "changed":
                ctl.put((int(np.count_nonzero(remote)), int(np.count_nonzero(mem[N:]))))
        return True


async def refused_or_dropped(eng: afabric.Engine, op: asyncio.Future[None] | object) -> str:
    """What the initiator saw for an access the target must refuse: the error class, or
    "ok" where the provider does not report refusals (libfabric 2.x shm)."""
    try:
        await asyncio.wait_for(op, OP_TIMEOUT + 15)  # type: ignore[arg-type]
    except errors.TransportError as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def expect_refusal_reported(provider: str, seen: str) -> None:
    if provider == "tcp":
        assert seen != "ok", "tcp accepted a write it must refuse"
    elif libfabric_version() < (2, 0):
        # 1.17 shm drops it without an answer; the provider sees its target's queue drained
        # with the write still pending, and fails it (ofi_shmfence.c)
        assert seen.startswith("RemoteKeyRejected"), seen


async def write_through_reset(eng: afabric.Engine, src: afabric.MemoryRegion, desc: afabric.MrDesc) -> None:
    """tcp;ofi_rxm (1.17) resets the connection after a refused access: the next write may
    fail with PeerUnreachable before it reconnects (docs/limitations.md)."""
    for _ in range(3):
        with contextlib.suppress(errors.PeerUnreachable):
            await eng.write(src, desc, 8)
            return
        await asyncio.sleep(0.1)
    await eng.write(src, desc, 8)


async def test_forged_descriptor_reaching_beyond_its_region(provider: str, peers: list[Peer]) -> None:
    """A descriptor re-sealed with a larger length passes every check the initiator can
    make, but the key still belongs to the original region: the target's provider refuses
    the write into the local-only region behind it, and nothing there changes."""
    target = Peer(guarded_target, provider)
    peers.append(target)
    blob, local_off = await target.get()
    forged = afabric.MrDesc.from_bytes(forge_descriptor(blob, length=local_off + N))
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(np.full(N, 0xEE, dtype=np.uint8))
        seen = await refused_or_dropped(eng, eng.write(src, forged, N, dst_offset=local_off))
        print(f"\n{provider}: write through a widened descriptor -> {seen}")
        expect_refusal_reported(provider, seen)
        target.put("changed")
        assert await target.get() == (0, 0), "a forged descriptor wrote outside its region"
        # the genuine descriptor still works (1.17 shm: once the provider has released the
        # dropped write, which otherwise holds up every later completion: ofi_shmfence.c)
        await write_through_reset(eng, src, afabric.MrDesc.from_bytes(blob))
        target.put("changed")
        assert (await target.get())[0] == 8
    target.put("stop")
    assert await target.result() is True


async def test_deregistration_revokes_at_once(provider: str, peers: list[Peer]) -> None:
    """After deregister() returns, a write with the old descriptor changes nothing."""
    target = Peer(guarded_target, provider)
    peers.append(target)
    blob, _ = await target.get()
    desc = afabric.MrDesc.from_bytes(blob)
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(np.full(N, 0xEE, dtype=np.uint8))
        await eng.write(src, desc, N)
        target.put("changed")
        assert (await target.get())[0] == N
        target.put("deregister")
        assert await target.get() == "revoked"
        seen = await refused_or_dropped(eng, eng.write(src, desc, N))
        print(f"\n{provider}: write with a revoked key -> {seen}")
        expect_refusal_reported(provider, seen)
        target.put("changed")
        assert await target.get() == (0, 0), "a write landed after deregistration"
    target.put("stop")
    assert await target.result() is True


@pytest.mark.parametrize("provider", WITH_CMA)
async def test_write_to_a_revoked_key_says_so(provider: str, peers: list[Peer]) -> None:
    """A write with the descriptor of a deregistered region fails with RemoteKeyRejected
    naming the key and what the initiator can tell (the target refused it: deregistered, or
    never valid), the provider's own words kept (before, tcp: "Operation canceled: No such
    file or directory (EIO)"; shm: a dropped write, no key). cma, which reads the target's
    export table itself, knows for certain and says "no longer registered"."""
    if provider != "cma" and libfabric_version() >= (2, 0):
        pytest.skip("libfabric 2.x reports refusals otherwise (docs/limitations.md)")
    target = Peer(guarded_target, provider)
    peers.append(target)
    blob, _ = await target.get()
    desc = afabric.MrDesc.from_bytes(blob)
    assert f"key={desc.keys[0]:016x}" in repr(desc)
    target.put("deregister")
    assert await target.get() == "revoked"
    async with afabric.Engine(provider, op_timeout=OP_TIMEOUT) as eng:
        src = eng.register(np.full(N, 0xEE, dtype=np.uint8))
        with pytest.raises(errors.RemoteKeyRejected) as refused:
            await asyncio.wait_for(eng.write(src, desc, 8), OP_TIMEOUT + 15)
    text = str(refused.value)
    print(f"\n{provider}: {text}")
    assert f"remote key {desc.keys[0]:016x}" in text, text
    if provider == "cma":
        assert "no longer) registered at the target" in text, text
    else:
        assert "its region was deregistered, or the key or range is not valid there" in text, text
        assert f"[provider={provider}]" in text, text
    target.put("stop")
    assert await target.result() is True


def nic_sockaddr(addr: afabric.Address) -> tuple[str, int]:
    """The IPv4 address and port a tcp engine's (single) NIC address names."""
    blob = bytes(addr)
    name_len = blob[5]
    at = 16 + name_len
    (n,) = struct.unpack_from("<H", blob, at)
    sa = blob[at + 2 : at + 2 + n]
    family = struct.unpack_from("<H", sa, 0)[0]
    assert family == socket.AF_INET, f"not an IPv4 sockaddr: {sa.hex()}"
    return socket.inet_ntoa(sa[4:8]), struct.unpack_from(">H", sa, 2)[0]


def other_ipv4() -> str | None:
    """An address of this host that is not loopback, if there is one."""
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.254", 9))  # no packet is sent: this only picks a route
        ip = str(s.getsockname()[0])
        return None if ip.startswith("127.") else ip
    return None


async def test_tcp_listens_on_loopback_only_by_default() -> None:
    async with afabric.Engine("tcp") as eng:
        ip, port = nic_sockaddr(eng.address)
        assert ip == "127.0.0.1"
        other = other_ipv4()
        if other is None:
            pytest.skip("no non-loopback IPv4 address to try from")
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.settimeout(5)
            s.connect((other, port))


async def message_sink(ctl: Ctl, provider: str) -> list[int]:
    """Receives with the default maximum (64 KiB) and reports what it got."""
    async with afabric.Engine(provider) as eng:
        ctl.put(bytes(eng.address))
        got = [len(await asyncio.wait_for(eng.recv_bytes(), 30)) for _ in range(3)]
        got.append(int(eng.stats()["nics"][0]["errors"]))
        return got


async def test_messages_bounded_by_the_receivers_maximum(provider: str, peers: list[Peer]) -> None:
    """No frame larger than the receiver announced in its address is posted: the facade
    sends a larger message in fragments (messages.py), and the shim refuses a frame over
    the limit before posting (MessageTooLarge). A frame over the limit from a sender that
    did not check (an address without the limit) is refused by the receiver's provider:
    counted as a failed receive, never delivered, and the receiver goes on."""
    sink = Peer(message_sink, provider)
    peers.append(sink)
    addr_b = await sink.get()
    addr = afabric.Address.from_bytes(addr_b)
    async with afabric.Engine(provider, max_message_size=1 << 20, op_timeout=OP_TIMEOUT) as eng:
        pid, _ = eng._peer(addr)
        with pytest.raises(errors.MessageTooLarge, match="peer's maximum"):
            eng._n.send("send", pid, bytes(65537))  # the shim's own check, under the facade
        await eng.send(addr, bytes(65537))  # over the receiver's maximum: fragments
        await eng.send(addr, bytes(65536))  # so is its maximum itself (the header adds to it)
        if provider == "shm":
            # shm (1.17 and 2.5.1) stops delivering after an oversize message: the
            # sender-side check above is all that protects there (docs/limitations.md)
            await eng.send(addr, b"x")
            assert await sink.result() == [65537, 65536, 1, 0]
            return
        unchecked = afabric.Address.from_bytes(address_without_limit(addr_b))
        with contextlib.suppress(errors.TransportError):  # tcp: transmit-complete, no error
            await eng.send(unchecked, bytes(100_000))
        await eng.send(addr, b"x")
        got = await sink.result()
        assert got == [65537, 65536, 1, 1], "the oversize message was delivered or not counted"
