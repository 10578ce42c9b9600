"""Messages that say who sent them, tags, messages of any size, recv_into and the bounds:
real engines, real processes, tcp and shm."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time

import numpy as np
import pytest

import afabric
from afabric import errors, messages

from .procs import Ctl, Peer

MiB = 1 << 20
N_CLIENTS = 4
BIG = 256 * MiB


# ---- senders ----


async def reply_server(ctl: Ctl, provider: str, n: int) -> list[tuple[str, bool]]:
    """Answers n requests, each to msg.sender (the requests carry no address)."""
    async with afabric.Engine(provider) as eng:
        ctl.put(bytes(eng.address))
        seen = []
        for _ in range(n):
            msg = await asyncio.wait_for(eng.recv(), 60)
            await eng.send(msg.sender, b"re:" + bytes(msg.data))
            seen.append((str(msg.sender), msg.verified))
        return seen


async def client(ctl: Ctl, provider: str, server_b: bytes, rounds: int) -> tuple[str, int]:
    server = afabric.Address.from_bytes(server_b)
    async with afabric.Engine(provider) as eng:
        me = str(eng.address)
        verified = 0
        for i in range(rounds):
            body = f"{me} {i}".encode()
            await eng.send(server, body)
            reply = await asyncio.wait_for(eng.recv(), 60)
            assert reply.data == b"re:" + body, (reply.data, body)
            assert reply.sender == server
            verified += reply.verified
        return me, verified


async def test_four_clients_get_replies_by_sender(provider: str, peers: list[Peer]) -> None:
    rounds = 5
    server = Peer(reply_server, provider, N_CLIENTS * rounds)
    peers.append(server)
    server_b = await server.get()
    clients = [Peer(client, provider, server_b, rounds) for _ in range(N_CLIENTS)]
    peers.extend(clients)
    results = [await c.result(120) for c in clients]
    seen = await server.result(120)
    names = {me for me, _ in results}
    assert len(names) == N_CLIENTS
    assert {s for s, _ in seen} == names  # every request named its own client
    for _me, verified in results:
        # the client resolved the server before it wrote: the provider names the server
        assert verified == rounds
    # a client is unresolved at the server until the first reply: later requests are named
    # by the provider and checked against their header
    per_client = {me: [v for s, v in seen if s == me] for me in names}
    for flags in per_client.values():
        assert all(flags[2:]), flags


async def test_a_forged_sender_is_dropped_where_the_provider_names_senders(provider: str) -> None:
    async with (
        afabric.Engine(provider) as rx,
        afabric.Engine(provider) as honest,
        afabric.Engine(provider) as forger,
    ):
        # rx resolves both (as a server does by replying): the provider then names them
        await rx.send(honest.address, b"hello")
        await rx.send(forger.address, b"hello")
        first = [await honest.recv(), await forger.recv()]
        assert not any(m.verified for m in first)  # neither had resolved rx: the claim only
        assert all(m.sender == rx.address for m in first)
        pid, _ = forger._peer(rx.address)
        fake = messages.frame(messages.K_DATA, bytes(honest.address), 0, payload=b"I am honest")
        forger._n.send("send", pid, fake)
        await forger.send(rx.address, b"I am the forger")
        await honest.send(rx.address, b"I am honest, really")
        got = {bytes(m.data): m for m in [await asyncio.wait_for(rx.recv(), 20) for _ in range(2)]}
        assert set(got) == {b"I am the forger", b"I am honest, really"}
        assert got[b"I am the forger"].sender == forger.address
        assert got[b"I am honest, really"].sender == honest.address
        assert all(m.verified for m in got.values())
        deadline = time.monotonic() + 10
        while rx.stats()["messages_forged"] < 1 and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # a counter: nothing to wait on
        assert rx.stats()["messages_forged"] == 1
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(rx.recv(), 0.3)


async def test_with_an_allow_list_every_sender_is_verified(provider: str) -> None:
    """A listed peer's messages, small and large, arrive verified; an unlisted peer's
    large message is never taken (its announcement is dropped: its send times out)."""
    async with (
        afabric.Engine(provider) as rx,
        afabric.Engine(provider) as listed,
        afabric.Engine(provider, op_timeout=1) as other,
    ):
        rx.allow_peers([listed.address])
        await listed.send(rx.address, b"small")
        await listed.send(rx.address, bytes(3 * MiB))
        got = [await asyncio.wait_for(rx.recv(), 20) for _ in range(2)]
        assert sorted(len(m.data) for m in got) == [5, 3 * MiB]
        assert all(m.verified and m.sender == listed.address for m in got)
        with pytest.raises(errors.OperationTimeout):
            await other.send(rx.address, bytes(3 * MiB))
        assert rx.stats()["nics"][0]["rejected"] >= 1 and rx.stats()["large_in_progress"] == 0


async def test_a_forger_the_receiver_never_resolved_stays_a_claim(provider: str) -> None:
    """The provider names only senders the receiver has resolved: a forged header from a
    peer it never resolved stays what the header claims (not verified), also once the
    receiver's completion queue went round with a resolved peer's messages (1.17's shm
    reports, for a sender not in the receiver's AV, the source its queue slot last held:
    the resolved peer's, which would verify the forgery)."""
    async with (
        afabric.Engine(provider, rx_depth=8, tx_depth=8) as rx,  # a completion queue of 32
        afabric.Engine(provider) as honest,
        afabric.Engine(provider) as forger,
    ):
        await rx.send(honest.address, b"hello")  # rx resolves honest: the provider names it
        await asyncio.wait_for(honest.recv(), 20)
        for _ in range(3):
            await asyncio.gather(*(honest.send(rx.address, b"%d" % i) for i in range(40)))
            got = [await asyncio.wait_for(rx.recv(), 20) for _ in range(40)]
            assert all(m.verified and m.sender == honest.address for m in got)
        pid, _ = forger._peer(rx.address)
        fake = messages.frame(messages.K_DATA, bytes(honest.address), 0, payload=b"I am honest")
        forger._n.send("send", pid, fake)
        msg = await asyncio.wait_for(rx.recv(), 20)
        assert bytes(msg.data) == b"I am honest" and msg.sender == honest.address
        assert not msg.verified
        await honest.send(rx.address, b"really")
        msg = await asyncio.wait_for(rx.recv(), 20)
        assert bytes(msg.data) == b"really" and msg.verified
        assert rx.stats()["messages_forged"] == 0


# ---- engines of one process ----

LARGE = 64 * MiB


async def counting_receiver(
    ctl: Ctl, provider: str, n: int
) -> tuple[list[tuple[bytes, bytes, bool]], int, int]:
    """Receives n messages; stops early once one was dropped as forged or malformed (or
    nothing more came for 60 s). Returns (sender, data (a digest for a large one),
    verified) of each, and the forged and malformed counts."""
    async with afabric.Engine(provider) as eng:
        ctl.put(bytes(eng.address))
        got: list[tuple[bytes, bytes, bool]] = []
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            st = eng.stats()
            if st["messages_forged"] or st["messages_malformed"]:
                break
            try:
                msg = await asyncio.wait_for(eng.recv(), 0.2)
            except asyncio.TimeoutError:
                continue
            data = bytes(msg.data) if len(msg.data) < 1024 else hashlib.sha256(msg.data).digest()
            got.append((bytes(msg.sender), data, msg.verified))
        st = eng.stats()
        return got, st["messages_forged"], st["messages_malformed"]


# shm with 2 and 8 engines, tcp (sources from its connections) once: 64 MiB takes a while
@pytest.mark.parametrize(("provider", "n_engines"), [("shm", 2), ("shm", 8), ("tcp", 2)])
async def test_engines_of_one_process_are_told_apart_after_a_large_message(
    provider: str, n_engines: int, peers: list[Peer]
) -> None:
    """Engines of one process send to a receiver in another: the first one a 64 MiB
    message, whose fragments go round the receiver's completion queue, then every one a
    few small ones. All arrive, each with its own engine as sender; none is taken for a
    forgery (1.17's shm reports, for a sender not in the receiver's AV, the source its queue
    slot last held: after the fragments, the first engine's, which would make the others'
    messages read as forgeries of it)."""
    per_engine = 3
    data = _pattern(LARGE, 3)
    rx = Peer(counting_receiver, provider, 1 + per_engine * n_engines)
    peers.append(rx)
    rx_addr = afabric.Address.from_bytes(await rx.get())
    async with contextlib.AsyncExitStack() as stack:
        engs = [await stack.enter_async_context(afabric.Engine(provider)) for _ in range(n_engines)]
        await engs[0].send(rx_addr, memoryview(data))
        await asyncio.gather(
            *(e.send(rx_addr, b"%d:%d" % (i, j)) for j in range(per_engine) for i, e in enumerate(engs))
        )
        got, forged, malformed = await rx.result(90)
    assert (forged, malformed) == (0, 0)
    digest = hashlib.sha256(data).digest()
    assert [sender for sender, body, _ in got if body == digest] == [bytes(engs[0].address)]
    by_sender: dict[bytes, list[tuple[bytes, bool]]] = {}
    for sender, body, verified in got:
        if body != digest:
            by_sender.setdefault(sender, []).append((body, verified))
    assert len(got) == 1 + per_engine * n_engines
    for i, e in enumerate(engs):
        mine = by_sender.get(bytes(e.address), [])
        assert sorted(b for b, _ in mine) == [b"%d:%d" % (i, j) for j in range(per_engine)]
    # the receiver resolved the first engine to answer its large message, before that one's
    # small ones left: the provider names it (the others it resolves when their hellos come)
    assert all(v for _, v in by_sender[bytes(engs[0].address)])


# ---- tags ----


async def tag_sender(ctl: Ctl, provider: str, rx_b: bytes, per_tag: int, tags: list[int]) -> int:
    rx = afabric.Address.from_bytes(rx_b)
    async with afabric.Engine(provider) as eng:
        sends = [
            eng.send(rx, b"%d:%d" % (tag, i), tag=tag) for i in range(per_tag) for tag in tags
        ]  # interleaved: tag after tag
        await asyncio.gather(*sends)
        await ctl.get()
        return len(sends)


@pytest.mark.both_loops
async def test_tags_interleaved_with_concurrent_receivers(provider: str, peers: list[Peer]) -> None:
    tags, per_tag, unclaimed = [0, 1, 7, 2**32 - 1], 50, 99
    async with afabric.Engine(provider) as eng:
        p = Peer(tag_sender, provider, bytes(eng.address), per_tag, [*tags, unclaimed])
        peers.append(p)

        async def take(tag: int) -> list[bytes]:
            return [bytes((await eng.recv(tag=tag)).data) for _ in range(per_tag)]

        got = await asyncio.wait_for(asyncio.gather(*(take(t) for t in tags)), 60)
        for tag, msgs in zip(tags, got, strict=True):
            assert sorted(msgs) == sorted(b"%d:%d" % (tag, i) for i in range(per_tag))
        # nobody asked for the unclaimed tag: held, counted, not dropped
        deadline = time.monotonic() + 20
        while eng.stats()["messages_by_tag"].get(unclaimed, 0) < per_tag:
            assert time.monotonic() < deadline, eng.stats()
            await asyncio.sleep(0.01)  # a counter: nothing to wait on
        st = eng.stats()
        assert st["messages_by_tag"] == {unclaimed: per_tag}
        assert st["messages_queued"] == per_tag and st["messages_dropped"] == 0
        late = [bytes((await eng.recv(tag=unclaimed)).data) for _ in range(per_tag)]
        assert sorted(late) == sorted(b"%d:%d" % (unclaimed, i) for i in range(per_tag))
        p.put("done")
        assert await p.result() == per_tag * (len(tags) + 1)


async def test_cancelled_recv_loses_no_message(provider: str) -> None:
    n = 1000  # below max_queued_messages: 1.17 tcp drops beyond it (queue_overflow "drop")
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        sending = asyncio.ensure_future(
            asyncio.gather(*(a.send(b.address, b"%d" % i, tag=3) for i in range(n)))
        )
        got: list[bytes] = []
        cancels = 0
        while len(got) < n:
            task = asyncio.ensure_future(b.recv(tag=3))
            await asyncio.sleep(0)  # let it register, maybe receive
            if cancels % 2 == 0:
                task.cancel()
                cancels += 1
                with contextlib.suppress(asyncio.CancelledError):
                    got.append(bytes((await task).data))
            else:
                cancels += 1
                got.append(bytes((await asyncio.wait_for(task, 20)).data))
        await sending
        assert sorted(got) == sorted(b"%d" % i for i in range(n))
        assert b.stats()["messages_queued"] == 0


async def test_tags_are_checked() -> None:
    async with afabric.Engine("tcp") as eng:
        for bad in (-1, 2**32, 1.0, True, "1"):
            with pytest.raises(errors.InvalidArgument):
                await eng.send(eng.address, b"x", tag=bad)  # type: ignore[arg-type]
            with pytest.raises(errors.InvalidArgument):
                await eng.recv(tag=bad)  # type: ignore[arg-type]
        # afabric's own tags are separate from the application's
        assert messages.TAG_KVCACHE > afabric.TAG_MAX and messages.TAG_WEIGHTS > afabric.TAG_MAX


# ---- any size ----


def _pattern(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


async def big_sender(ctl: Ctl, provider: str, rx_b: bytes, n: int, seed: int, tag: int) -> float:
    rx = afabric.Address.from_bytes(rx_b)
    data = _pattern(n, seed)
    async with afabric.Engine(provider) as eng:
        t0 = time.perf_counter()
        await eng.send(rx, memoryview(data), tag=tag)
        return time.perf_counter() - t0


async def test_256mib_message_byte_exact(provider: str, peers: list[Peer]) -> None:
    async with afabric.Engine(provider) as eng:
        p = Peer(big_sender, provider, bytes(eng.address), BIG, 11, 5)
        peers.append(p)
        msg = await asyncio.wait_for(eng.recv(tag=5), 120)
        assert len(msg.data) == BIG
        assert np.array_equal(np.frombuffer(msg.data, dtype=np.uint8), _pattern(BIG, 11))
        elapsed = await p.result(60)
        st = eng.stats()
        assert st["bytes_reserved"] == 0 and st["large_in_progress"] == 0
        print(f"256 MiB over {provider}: send took {elapsed:.2f} s ({BIG / elapsed / 1e9:.2f} GB/s)")


async def test_recv_into(provider: str) -> None:
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        small, big = b"small one", _pattern(3 * MiB + 5, 2)
        await a.send(b.address, small, tag=1)
        await a.send(b.address, memoryview(big), tag=1)
        out = np.zeros(4 * MiB, dtype=np.uint8)
        mr = b.register(out)
        msg = await asyncio.wait_for(b.recv_into(mr, tag=1), 30)
        assert bytes(msg.data) == small and msg.sender == a.address
        assert bytes(out[: len(small)]) == small
        # too small a buffer: an error, and the message stays for the next receive
        tiny = bytearray(MiB)
        with pytest.raises(errors.MessageTooLarge):
            await asyncio.wait_for(b.recv_into(tiny, tag=1), 30)
        msg = await b.recv_into(mr, tag=1)
        assert len(msg.data) == len(big) and np.array_equal(out[: len(big)], big)
        assert isinstance(msg.data, memoryview)
        with pytest.raises(errors.InvalidArgument):
            await b.recv_into(b"read only", tag=1)
        b.deregister(mr)


async def test_recv_into_waiting_reassembles_in_place(provider: str) -> None:
    """A recv_into already waiting when a large message is announced gets it reassembled in
    its own buffer (nothing reserved of max_queued_bytes); cancelled half-way, the message
    goes on in memory of the engine's and reaches the next recv."""
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        data = _pattern(32 * MiB, 4)
        out = np.zeros(40 * MiB, dtype=np.uint8)
        waiting = asyncio.ensure_future(b.recv_into(out, tag=2))
        await asyncio.sleep(0)
        await a.send(b.address, data.data, tag=2)
        msg = await asyncio.wait_for(waiting, 30)
        assert isinstance(msg.data, memoryview) and msg.data.obj is out
        assert np.array_equal(out[: len(data)], data)
        assert b.stats()["messages_expired"] == 0
        # cancelled while its message arrives
        out[:] = 0
        waiting = asyncio.ensure_future(b.recv_into(out, tag=2))
        await asyncio.sleep(0)
        sending = asyncio.ensure_future(a.send(b.address, data.data, tag=2))
        deadline = time.monotonic() + 30
        while b.stats()["large_bytes_arrived"] < MiB:
            assert time.monotonic() < deadline and not sending.done(), b.stats()
            await asyncio.sleep(0.001)  # a counter: nothing to wait on
        assert b.stats()["bytes_reserved"] == 0  # in the caller's buffer
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert b.stats()["bytes_reserved"] == len(data)  # now in the engine's own memory
        await asyncio.wait_for(sending, 30)
        msg = await asyncio.wait_for(b.recv(tag=2), 30)
        assert np.array_equal(np.frombuffer(msg.data, dtype=np.uint8), data)
        assert b.stats()["bytes_reserved"] == 0


# ---- bounds ----


async def test_large_messages_are_bounded_and_held_back(provider: str) -> None:
    """Memory for large messages is reserved before their fragments leave the sender; a
    message that does not fit waits at the sender (never dropped at the receiver), one
    larger than the bound is refused, one that never gets room times out."""
    limit = 8 * MiB
    async with (
        afabric.Engine(provider, max_queued_bytes=limit) as rx,
        afabric.Engine(provider, op_timeout=30) as tx,
    ):
        one, two = _pattern(6 * MiB, 1), _pattern(6 * MiB, 2)
        first = asyncio.ensure_future(tx.send(rx.address, memoryview(one), tag=1))
        second = asyncio.ensure_future(tx.send(rx.address, memoryview(two), tag=2))
        done, _ = await asyncio.wait([first, second], return_when=asyncio.FIRST_COMPLETED, timeout=30)
        assert len(done) == 1
        await asyncio.sleep(0.5)
        st = rx.stats()
        assert st["bytes_reserved"] == 6 * MiB <= limit
        assert st["large_waiting"] == 1 and st["messages_queued"] == 1
        assert not (first.done() and second.done())
        got = await rx.recv(tag=1 if first.done() else 2)  # makes room: the other one goes
        await asyncio.wait_for(asyncio.gather(first, second), 30)
        other = await rx.recv(tag=2 if got.tag == 1 else 1)
        by_tag = {got.tag: got, other.tag: other}
        assert bytes(by_tag[1].data) == one.tobytes() and bytes(by_tag[2].data) == two.tobytes()
        assert rx.stats()["bytes_reserved"] == 0
        with pytest.raises(errors.MessageTooLarge, match="at most"):
            await tx.send(rx.address, bytes(limit + 1))
        assert rx.stats()["messages_refused"] == 1
    async with (
        afabric.Engine(provider, max_queued_bytes=limit) as rx,
        afabric.Engine(provider, op_timeout=1) as tx,
    ):
        await tx.send(rx.address, bytes(6 * MiB))
        with pytest.raises(errors.OperationTimeout, match="did not take it"):
            await tx.send(rx.address, bytes(6 * MiB))
        assert len(await rx.recv()) == 6 * MiB


async def dying_sender(ctl: Ctl, provider: str, rx_b: bytes) -> None:
    rx = afabric.Address.from_bytes(rx_b)
    async with afabric.Engine(provider) as eng:
        ctl.put("go")
        await eng.send(rx, bytes(BIG))  # killed on the way


async def test_a_dead_senders_partial_message_is_freed(
    provider: str, peers: list[Peer], shm_cleanup: None
) -> None:
    async with afabric.Engine(provider, op_timeout=2) as eng:
        p = Peer(dying_sender, provider, bytes(eng.address))
        peers.append(p)
        await p.get()
        deadline = time.monotonic() + 60
        while eng.stats()["large_bytes_arrived"] < 4 * MiB:
            assert time.monotonic() < deadline, eng.stats()
            await asyncio.sleep(0.001)  # a counter: nothing to wait on
        p.kill()
        st = eng.stats()
        assert st["large_in_progress"] == 1 and st["bytes_reserved"] == BIG, st
        assert 0 < st["large_bytes_arrived"] < BIG
        deadline = time.monotonic() + 10
        while eng.stats()["large_in_progress"] and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.05)  # a counter: nothing to wait on
        st = eng.stats()
        assert st["large_in_progress"] == 0 and st["bytes_reserved"] == 0 and st["large_bytes_arrived"] == 0
        assert st["messages_expired"] == 1 and st["messages_queued"] == 0
        # the engine goes on
        async with afabric.Engine(provider) as other:
            await other.send(eng.address, b"still here")
            assert (await asyncio.wait_for(eng.recv(), 20)).data == b"still here"


# ---- typed ----


async def test_stats_has_the_typed_keys(provider: str) -> None:
    """stats() is afabric.EngineStats and each NIC's counters afabric.NicStats: the same
    keys (a counter added to the shim must be added to the TypedDict too)."""
    from afabric import _native

    async with afabric.Engine(provider) as eng:
        st = eng.stats()
        assert set(st) == set(afabric.EngineStats.__annotations__) | set(
            afabric.stats.MessageStats.__annotations__
        )
        native = {f[0] for f in _native.NicStats._fields_} | {"outstanding", "transport"}
        assert set(afabric.NicStats.__annotations__) == native
        assert all(set(n) == native for n in st["nics"])


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_reply_server_example_runs_as_written(provider: str) -> None:
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parent.parent / "examples" / "reply_server.py"
    proc = subprocess.run(
        [sys.executable, str(example), provider], check=False, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert f"server: answered {4 * 3} requests from 4 clients" in proc.stdout
    assert proc.stdout.count("answers and the 8 MiB table") == 4


async def hello_from(ctl: Ctl, rx_b: bytes) -> str:
    """Sends one message to rx, waits for its answer; returns its own address."""
    rx = afabric.Address.from_bytes(rx_b)
    async with afabric.Engine("tcp") as eng:
        await eng.send(rx, b"hello")
        reply = await asyncio.wait_for(eng.recv(), 30)
        assert reply.data == b"re:hello"
        ctl.put(bytes(eng.address))
        await ctl.get()  # killed here (the first) or told to stop
        return str(eng.address)


def nic_part(addr: afabric.Address) -> bytes:
    """An address's provider name and NIC addresses: what a restart at the same port keeps
    (the header's incarnation and the owner-process block after the NICs change)."""
    blob = bytes(addr)
    nics, name_len = blob[4], blob[5]
    pos = 16 + name_len
    for _ in range(nics):
        pos += 2 + int.from_bytes(blob[pos : pos + 2], "little")
    return blob[16:pos]


async def test_a_peer_restarted_at_the_same_address_is_not_taken_for_a_forger(peers: list[Peer]) -> None:
    """tcp on a fixed port: a restarted client has the same NIC address (and, in the
    provider's address vector, possibly the old one's handle) but a new incarnation. Its
    messages are its own, verified once resolved, never dropped as forged."""
    from .test_faults import fixed_port_env, free_port

    env = fixed_port_env(free_port())
    async with afabric.Engine("tcp") as rx:

        async def serve_one() -> afabric.Message:
            msg = await asyncio.wait_for(rx.recv(), 15)
            await rx.send(msg.sender, b"re:" + bytes(msg.data))
            return msg

        first = Peer(hello_from_env, bytes(rx.address), env)
        peers.append(first)
        m1 = await serve_one()
        assert afabric.Address.from_bytes(await first.get()) == m1.sender
        first.kill()
        for _ in range(8):  # the port may take a moment to be free again
            second = Peer(hello_from_env, bytes(rx.address), env)
            peers.append(second)
            try:
                m2 = await serve_one()
                break
            except asyncio.TimeoutError:
                second.kill()
        else:
            pytest.fail("the restarted client never got through")
        new = afabric.Address.from_bytes(await second.get())
        assert m2.sender == new and nic_part(new) == nic_part(m1.sender)
        assert rx.stats()["messages_forged"] == 0
        # now resolved: the provider names it, and its header agrees
        await rx.send(new, b"again?")
        second.put("stop")
        assert await second.result() == str(new)
        assert rx.stats()["messages_forged"] == 0


async def hello_from_env(ctl: Ctl, rx_b: bytes, env: dict[str, str]) -> str:
    import os

    os.environ.update(env)
    return await hello_from(ctl, rx_b)
