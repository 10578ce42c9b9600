"""The nvlink provider (CUDA IPC between the GPUs of one node) with the transport contract of
the others: contiguous and paged writes, immediates counted only after the data landed,
early arrivals kept, SEND/RECV, bad input refused before anything is posted or by the
target's export table, a killed peer failing futures in bounded time - between two
processes and between two engines of one process, each both on one GPU (``same-gpu``: the
colocated case, CUDA IPC within cuda0, which a one-GPU machine runs) and across two GPUs
(``cross-gpu``: cuda0 -> cuda1, skipped with fewer than two GPUs or without peer access).

Peers are subprocesses running this file (a line protocol over stdin/stdout, no pickling
of test functions), so the tests work with pytest's importlib mode. Plain functions with
their own event loop (no pytest plugin needed). Skipped, not faked, without a CUDA GPU
and CuPy (failed instead where AFABRIC_REQUIRE_GPU=1); on a machine without CUDA the one
test that runs checks that the provider reports itself unavailable, cleanly.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import hashlib
import json
import os
import struct
import subprocess
import sys
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import numpy as np
import pytest

import afabric
from afabric import errors, registry

KiB, MiB = 1 << 10, 1 << 20
PROVIDER = "nvlink"


def _unavailable(why: str) -> NoReturn:
    if os.environ.get("AFABRIC_REQUIRE_GPU") == "1":
        pytest.fail(f"AFABRIC_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


@functools.cache
def _probe() -> str:
    """Empty when a CUDA GPU, CuPy and the provider are usable; else why not."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or CUDA libraries CuPy cannot load
        return f"CuPy is not usable here ({type(e).__name__}: {e})"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver or no device
        return f"no CUDA GPU ({type(e).__name__}: {e})"
    if n < 1:
        return "no CUDA GPU"
    avail = registry.probe(PROVIDER)
    if not avail.available:
        return f"provider nvlink unavailable: {avail.reason}"
    return ""


def _cp(dst: int = 0) -> Any:
    """CuPy, once the provider is usable and GPU `dst` (the target's) is there: the
    cross-GPU case is skipped (whatever AFABRIC_REQUIRE_GPU says) with one GPU, or when
    cuda0 has no peer access to it."""
    why = _probe()
    if why:
        _unavailable(why)
    import cupy

    n = int(cupy.cuda.runtime.getDeviceCount())
    if dst >= n:
        pytest.skip(f"{n} CUDA GPU(s): the cross-GPU case needs {dst + 1}")
    if dst and not cupy.cuda.runtime.deviceCanAccessPeer(0, dst):
        pytest.skip(f"cuda0 has no peer access to cuda{dst}")
    return cupy


# the target's GPU: cuda0 itself (colocated processes), or another GPU
TARGETS = pytest.mark.parametrize("dst", [0, 1], ids=["same-gpu", "cross-gpu"])


def pattern(n: int, seed: int) -> np.ndarray:
    x = np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)
    return (x >> np.uint64(29)).astype(np.uint8)


def on_gpu(cp: Any, host: np.ndarray, dev: int) -> Any:
    with cp.cuda.Device(dev):
        a = cp.asarray(host)
        cp.cuda.Device(dev).synchronize()
    return a


def sha(a: np.ndarray) -> str:
    return hashlib.sha256(a.tobytes()).hexdigest()


# ---- the peer process (this file run as a script) ----


async def _peer_main(dev: int, nbytes: int) -> None:
    import cupy as cp

    loop = asyncio.get_running_loop()

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    with cp.cuda.Device(dev):
        buf = cp.zeros(nbytes, dtype=cp.uint8)
    async with afabric.Engine(PROVIDER, nic=f"cuda{dev}") as eng:
        mr = eng.register(buf, remote="rw")  # written and read by the tests
        reply({"desc": bytes(mr.descriptor).hex(), "imm": eng.alloc_imm(), "addr": bytes(eng.address).hex()})
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            if not line:
                return
            cmd = json.loads(line)
            op = cmd["op"]
            try:
                if op == "expect":
                    await eng.expect_imm(cmd["imm"], cmd["n"], timeout=cmd.get("timeout", 60))
                    reply({"ok": True})
                elif op == "sha":
                    with cp.cuda.Device(dev):
                        cp.cuda.Device(dev).synchronize()
                        reply({"sha": sha(cp.asnumpy(buf))})
                elif op == "echo":
                    peer = afabric.Address.from_bytes(bytes.fromhex(cmd["peer"]))
                    for _ in range(cmd["rounds"]):
                        msg = await asyncio.wait_for(eng.recv_bytes(), 60)
                        await eng.send(peer, msg[::-1])
                    reply({"ok": True})
                elif op == "quit":
                    reply({"ok": True})
                    return
            except Exception as e:  # noqa: BLE001 - the test reads and reports it
                reply({"err": f"{type(e).__name__}: {e}"})


class Child:
    """A peer process: an nvlink engine owning `nbytes` of GPU `dev`'s memory."""

    def __init__(self, dev: int, nbytes: int) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(dev), str(nbytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )

    async def read(self, timeout: float = 120) -> dict[str, Any]:
        assert self.proc.stdout is not None
        pending = asyncio.get_running_loop().run_in_executor(None, self.proc.stdout.readline)
        line = await asyncio.wait_for(pending, timeout)
        if not line:
            raise AssertionError(f"peer {self.proc.pid} exited (code {self.proc.wait()})")
        msg: dict[str, Any] = json.loads(line)
        if "err" in msg:
            raise AssertionError(f"peer failed: {msg['err']}")
        return msg

    async def call(self, wait: float = 120, **cmd: Any) -> dict[str, Any]:
        """Send a command (its own `timeout` goes to the peer) and wait `wait` s for the reply."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return await self.read(wait)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait(30)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(BrokenPipeError, OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def run_with_child(dev: int, nbytes: int, body: Callable[[Child, dict[str, Any]], Awaitable[None]]) -> None:
    async def main() -> None:
        child = Child(dev, nbytes)
        try:
            hello = await child.read()
            await body(child, hello)
        finally:
            child.close()

    asyncio.run(main())


# ---- two processes, two GPUs ----


@TARGETS
def test_contiguous_writes_two_processes(dst: int) -> None:
    cp = _cp(dst)
    total = 64 * MiB

    async def body(child: Child, hello: dict[str, Any]) -> None:
        desc = afabric.MrDesc.from_bytes(bytes.fromhex(hello["desc"]))
        imm = hello["imm"]
        host = pattern(total, 7)
        src = on_gpu(cp, host, 0)
        async with afabric.Engine(PROVIDER, nic="cuda0") as eng:
            mr = eng.register(src, remote=False)
            # 60 x 1 MiB, then an odd-sized, odd-offset write of the rest but 13 bytes
            writes = [eng.write(mr, desc, MiB, src_offset=i * MiB, dst_offset=i * MiB, imm=imm)
                      for i in range(60)]  # fmt: skip
            at = 60 * MiB + 13
            writes.append(eng.write(mr, desc, total - at, src_offset=at, dst_offset=at, imm=imm))
            await asyncio.gather(*writes)
            await child.call(op="expect", imm=imm, n=61)
            want = host.copy()
            want[60 * MiB : 60 * MiB + 13] = 0
            assert (await child.call(op="sha"))["sha"] == sha(want), "bytes differ at the target"
            stats = eng.stats()["nics"][0]
            assert stats["writes"] == 61 and stats["errors"] == 0, stats
            # read it back through the same IPC mapping (the copy in the other direction):
            # contiguous in 4 concurrent pieces, 1024 shuffled 64 KiB pages, a gather
            with cp.cuda.Device(0):
                back = cp.zeros(total, dtype=cp.uint8)
            bmr = eng.register(back, remote=False)
            q = total // 4
            reads = [eng.read(bmr, desc, q, src_offset=k * q, dst_offset=k * q) for k in range(4)]
            await asyncio.gather(*reads)
            assert sha(cp.asnumpy(back)) == sha(want), "contiguous reads differ"
            pg = 64 * KiB
            npg = total // pg
            perm = np.random.default_rng(4).permutation(npg).astype(np.int64)
            await eng.read_paged(bmr, desc, page_len=pg, src_pages=afabric.Pages(perm, pg),
                                 dst_pages=afabric.Pages(np.arange(npg, dtype=np.int64), pg))  # fmt: skip
            assert sha(cp.asnumpy(back)) == sha(want.reshape(npg, pg)[perm].reshape(-1)), "paged reads differ"
            await eng.gather(bmr, [afabric.GatherSource(desc, MiB, 5 * MiB, 0),
                                   afabric.GatherSource(desc, MiB - 3, 3, MiB)])  # fmt: skip
            assert sha(cp.asnumpy(back[: 2 * MiB - 3])) == sha(
                np.concatenate([want[5 * MiB : 6 * MiB], want[3:MiB]])
            ), "gathered reads differ"
            stats = eng.stats()["nics"][0]
            assert stats["reads"] >= 4 + 2 and stats["errors"] == 0, stats

    run_with_child(dst, total, body)


@TARGETS
def test_paged_writes_two_processes(dst: int) -> None:
    cp = _cp(dst)
    page, npages = 4 * KiB, 8192
    odd_page, odd_n, odd_stride, odd_off = 100, 1000, 128, 4  # not 16-byte aligned: byte path
    total = page * npages

    async def body(child: Child, hello: dict[str, Any]) -> None:
        desc = afabric.MrDesc.from_bytes(bytes.fromhex(hello["desc"]))
        imm = hello["imm"]
        host = pattern(total, 11)
        src = on_gpu(cp, host, 0)
        rng = np.random.default_rng(3)
        s_idx, d_idx = rng.permutation(npages).astype(np.int64), rng.permutation(npages).astype(np.int64)
        async with afabric.Engine(PROVIDER, nic="cuda0") as eng:
            mr = eng.register(src, remote=False)
            await eng.write_paged(mr, desc, page_len=page, src_pages=afabric.Pages(s_idx, page),
                                  dst_pages=afabric.Pages(d_idx, page), imm=imm)  # fmt: skip
            await child.call(op="expect", imm=imm, n=npages)
            want = np.zeros(total, dtype=np.uint8)
            want.reshape(npages, page)[d_idx] = host.reshape(npages, page)[s_idx]
            assert (await child.call(op="sha"))["sha"] == sha(want), "4 KiB pages differ"
            # unaligned pages, strides and offsets on top (the kernel's byte path)
            o_src = rng.permutation(odd_n).astype(np.int64)
            o_dst = rng.permutation(odd_n).astype(np.int64)
            await eng.write_paged(mr, desc, page_len=odd_page, src_pages=afabric.Pages(o_src, odd_page, 3),
                                  dst_pages=afabric.Pages(o_dst, odd_stride, odd_off), imm=imm)  # fmt: skip
            await child.call(op="expect", imm=imm, n=odd_n)
            for k in range(odd_n):
                d0 = odd_off + int(o_dst[k]) * odd_stride
                s0 = 3 + int(o_src[k]) * odd_page
                want[d0 : d0 + odd_page] = host[s0 : s0 + odd_page]
            assert (await child.call(op="sha"))["sha"] == sha(want), "unaligned pages differ"

    run_with_child(dst, total, body)


@TARGETS
def test_early_arrivals_are_kept(dst: int) -> None:
    cp = _cp(dst)
    n = 50

    async def body(child: Child, hello: dict[str, Any]) -> None:
        desc = afabric.MrDesc.from_bytes(bytes.fromhex(hello["desc"]))
        imm = hello["imm"]
        src = on_gpu(cp, pattern(4096, 1), 0)
        async with afabric.Engine(PROVIDER, nic="cuda0") as eng:
            mr = eng.register(src, remote=False)
            # immediate-only and data-carrying writes, all before the target expects them
            await asyncio.gather(*(eng.write(mr, desc, (i % 2) * 64, imm=imm) for i in range(n)))
        await child.call(op="expect", imm=imm, n=n, timeout=10)
        with pytest.raises(AssertionError, match="OperationTimeout"):  # consumed: no 51st
            await child.call(op="expect", imm=imm, n=1, timeout=0.5)

    run_with_child(dst, 4096, body)


@TARGETS
def test_send_recv_two_processes(dst: int) -> None:
    _cp(dst)

    async def body(child: Child, hello: dict[str, Any]) -> None:
        server = afabric.Address.from_bytes(bytes.fromhex(hello["addr"]))
        async with afabric.Engine(PROVIDER, nic="cuda0") as eng:
            sizes = [0, 1, 100, 4096, eng.max_message_size, eng.max_message_size + 1]  # the last: fragments
            me = bytes(eng.address).hex()
            echo = asyncio.ensure_future(child.call(op="echo", peer=me, rounds=len(sizes)))
            rng = np.random.default_rng(5)
            for size in sizes:
                body_ = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
                await eng.send(server, body_)
                assert await asyncio.wait_for(eng.recv_bytes(), 30) == body_[::-1]
            await echo

    run_with_child(dst, 4096, body)


@TARGETS
def test_killed_target_fails_futures_and_engine_lives_on(dst: int, shm_cleanup: None) -> None:
    cp = _cp(dst)
    chunk = 256 * KiB

    async def body(child: Child, hello: dict[str, Any]) -> None:
        victim = afabric.MrDesc.from_bytes(bytes.fromhex(hello["desc"]))
        loop = asyncio.get_running_loop()
        src = on_gpu(cp, pattern(4 * MiB, 2), 0)
        with cp.cuda.Device(dst):
            live_buf = cp.zeros(MiB, dtype=cp.uint8)
        async with afabric.Engine(PROVIDER, nic="cuda0", op_timeout=5.0) as eng, \
                afabric.Engine(PROVIDER, nic=f"cuda{dst}") as other:  # fmt: skip
            mr = eng.register(src, remote=False)
            live = other.register(live_buf)
            ok, failures, inflight, i = 0, [], set(), 0
            killed_at: float | None = None
            while not failures and (killed_at is None or loop.time() - killed_at < 30):
                while len(inflight) < 8:
                    w = eng.write(mr, victim, chunk, dst_offset=(i % 16) * chunk)
                    inflight.add(asyncio.ensure_future(w))
                    i += 1
                done, inflight = await asyncio.wait(inflight, return_when=asyncio.FIRST_COMPLETED)
                for t in done:
                    if t.exception() is None:
                        ok += 1
                    else:
                        failures.append(t.exception())
                if killed_at is None and ok >= 20:
                    child.kill()
                    killed_at = loop.time()
            assert killed_at is not None and failures, "writes to a killed peer kept succeeding"
            if inflight:
                done, pending = await asyncio.wait(inflight, timeout=30)
                assert not pending, "futures still pending 30 s after the peer died"
                failures += [t.exception() for t in done if t.exception() is not None]
            assert loop.time() - killed_at < 35
            for f in failures:
                assert isinstance(f, errors.TransportError), repr(f)
            with pytest.raises(errors.PeerUnreachable):
                await asyncio.wait_for(eng.write(mr, victim, 64), 30)
            # the engine still writes to the living
            imm = other.alloc_imm()
            await eng.write(mr, live.descriptor, MiB, imm=imm)
            await other.expect_imm(imm, 1, timeout=30)
            assert sha(cp.asnumpy(live_buf)) == sha(cp.asnumpy(src[:MiB]))

    run_with_child(dst, 16 * chunk, body)


@TARGETS
def test_killed_peer_reported_down_within_a_second(dst: int, shm_cleanup: None) -> None:
    """Peer-down (shim/peers.c: the peer's process watched through a pidfd, whatever the
    provider): the engine yields a "down" event without posting anything, and writes in
    flight to it all fail with PeerUnreachable within 1 s of the SIGKILL (op_timeout 20 s)."""
    cp = _cp(dst)
    chunk = 256 * KiB

    async def body(child: Child, hello: dict[str, Any]) -> None:
        victim = afabric.MrDesc.from_bytes(bytes.fromhex(hello["desc"]))
        addr = afabric.Address.from_bytes(bytes.fromhex(hello["addr"]))
        loop = asyncio.get_running_loop()
        src = on_gpu(cp, pattern(chunk, 2), 0)
        async with afabric.Engine(PROVIDER, nic="cuda0", op_timeout=20.0) as eng:
            mr = eng.register(src, remote=False)
            await eng.write(mr, victim, chunk)
            events = eng.peer_events()
            up = await asyncio.wait_for(events.__anext__(), 10)
            assert (up.kind, up.address, up.watched) == ("up", addr, True)
            writes = [
                asyncio.ensure_future(eng.write(mr, victim, chunk, dst_offset=(k % 16) * chunk))
                for k in range(64)
            ]
            child.kill()
            t0 = loop.time()
            down = await asyncio.wait_for(events.__anext__(), 10)
            took_event = loop.time() - t0
            results = await asyncio.wait_for(asyncio.gather(*writes, return_exceptions=True), 10)
            took = loop.time() - t0
            failed = [r for r in results if isinstance(r, BaseException)]
            print(f"nvlink: down event {took_event * 1e3:.1f} ms, {len(failed)}/64 writes failed, "
                  f"all settled {took * 1e3:.1f} ms after the kill")  # fmt: skip
            assert (down.kind, down.reason) == ("down", "exited")
            assert all(isinstance(r, errors.PeerUnreachable) for r in failed), failed[:3]
            assert took < 1.0, took
            with pytest.raises(errors.PeerUnreachable, match="exited"):
                await eng.write(mr, victim, 64)

    run_with_child(dst, 16 * chunk, body)


# ---- one process, two engines ----


async def _engines(dst: int) -> tuple[afabric.Engine, afabric.Engine]:
    return afabric.Engine(PROVIDER, nic="cuda0"), afabric.Engine(PROVIDER, nic=f"cuda{dst}")


@TARGETS
def test_two_engines_one_process(dst: int) -> None:
    cp = _cp(dst)
    n = 16 * MiB

    async def main() -> None:
        e0, e1 = await _engines(dst)
        try:
            h0, h1 = pattern(n, 21), pattern(n, 22)
            a0, a1 = on_gpu(cp, h0, 0), on_gpu(cp, h1, dst)
            with cp.cuda.Device(0):
                b0 = cp.zeros(n, dtype=cp.uint8)
            with cp.cuda.Device(dst):
                b1 = cp.zeros(n, dtype=cp.uint8)
                same_dev = cp.zeros(n, dtype=cp.uint8)  # dst -> dst through the provider too
            s0, s1 = e0.register(a0, remote=False), e1.register(a1, remote=False)
            r0, r1, r_same = e0.register(b0), e1.register(b1), e0.register(same_dev)
            i0, i1 = e0.alloc_imm(), e1.alloc_imm()
            # cuda0 -> dst contiguous (one write) and dst -> cuda0 paged, concurrently
            pages = n // (32 * KiB)
            perm = np.random.default_rng(9).permutation(pages).astype(np.int64)
            await asyncio.gather(
                e0.write(s0, r1.descriptor, n, imm=i1),
                e1.write_paged(s1, r0.descriptor, page_len=32 * KiB, src_pages=afabric.Pages(perm, 32 * KiB),
                               dst_pages=afabric.Pages(np.arange(pages, dtype=np.int64), 32 * KiB), imm=i0),
                e1.write(s1, r_same.descriptor, n),
            )  # fmt: skip
            await e1.expect_imm(i1, 1, timeout=30)
            await e0.expect_imm(i0, pages, timeout=30)
            assert sha(cp.asnumpy(b1)) == sha(h0)
            assert sha(cp.asnumpy(b0)) == sha(h1.reshape(pages, -1)[perm].reshape(-1))
            assert sha(cp.asnumpy(same_dev)) == sha(h1)
            # a scatter to both engines (one of them itself) and a barrier, one arrival each
            group = e0.peer_group([e0.address, e1.address])
            targets = [afabric.ScatterTarget(r1.descriptor, MiB, 0, 5 * MiB),
                       afabric.ScatterTarget(r_same.descriptor, MiB, MiB, 7 * MiB)]  # fmt: skip
            k0, k1 = e0.alloc_imm(), e1.alloc_imm()
            await e0.scatter(s0, targets, group=group, imm=k1)
            await e1.expect_imm(k1, 1, timeout=30)
            assert sha(cp.asnumpy(b1[5 * MiB : 6 * MiB])) == sha(h0[:MiB])
            assert sha(cp.asnumpy(same_dev[7 * MiB : 8 * MiB])) == sha(h0[MiB : 2 * MiB])
            await e0.barrier([r0.descriptor], k0)
            await e0.expect_imm(k0, 1, timeout=30)
        finally:
            await e0.aclose()
            await e1.aclose()

    asyncio.run(main())


@TARGETS
def test_torch_tensors_two_engines(dst: int) -> None:
    """Tensors from torch's caching allocator (sub-ranges of larger cudaMalloc blocks)."""
    _cp(dst)
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA install under torch
        _unavailable(f"torch is not usable here ({type(e).__name__}: {e})")
    n = 3 * MiB + 5

    async def main() -> None:
        e0, e1 = await _engines(dst)
        try:
            pad0 = torch.empty(1000, dtype=torch.uint8, device="cuda:0")  # offset within a block
            src = (torch.arange(n, device="cuda:0") % 253).to(torch.uint8)
            pad1 = torch.empty(777, dtype=torch.uint8, device=f"cuda:{dst}")
            tgt = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{dst}")
            torch.cuda.synchronize(0)
            torch.cuda.synchronize(dst)
            s0, r1 = e0.register(src, remote=False), e1.register(tgt)
            imm = e1.alloc_imm()
            await e0.write(s0, r1.descriptor, n - 1, src_offset=1, dst_offset=0, imm=imm)
            await e1.expect_imm(imm, 1, timeout=30)
            assert torch.equal(tgt[: n - 1].cpu(), src[1:].cpu()) and int(tgt[n - 1]) == 0
            del pad0, pad1
        finally:
            await e0.aclose()
            await e1.aclose()

    asyncio.run(main())


@TARGETS
def test_triggered_writes_two_engines(dst: int) -> None:
    """Writes the shim posts itself, the KV-cache layer-by-layer pattern: e0's write fires when
    a GPU watcher reaches a value (bumped by the host here, as a kernel would), and e1 relays
    what arrived (a paged write, pages reversed) once it has counted that write's immediate."""
    cp = _cp(dst)
    half, page = 2 * MiB, 64 * KiB
    pages = half // page

    async def main() -> None:
        e0, e1 = await _engines(dst)
        try:
            h = pattern(half, 31)
            src = on_gpu(cp, h, 0)
            with cp.cuda.Device(0):
                back_buf = cp.zeros(half, dtype=cp.uint8)
            with cp.cuda.Device(dst):
                tgt = cp.zeros(half, dtype=cp.uint8)
            s0, r0, r1 = e0.register(src, remote=False), e0.register(back_buf), e1.register(tgt)
            layer, back = e1.alloc_imm(), e0.alloc_imm()
            w = e0.uvm_watcher(device=0)
            idx = np.arange(pages, dtype=np.int64)
            first = asyncio.ensure_future(e0.write(s0, r1.descriptor, half, imm=layer, when=w.reaches(1)))
            relay = asyncio.ensure_future(
                e1.write_paged(r1, r0.descriptor, page_len=page, src_pages=afabric.Pages(idx, page),
                               dst_pages=afabric.Pages(idx[::-1].copy(), page), imm=back,
                               when=afabric.imm_count(layer, 1))
            )  # fmt: skip
            await asyncio.sleep(0.2)
            assert not first.done() and not relay.done(), "a triggered write went before its trigger"
            assert not back_buf.any() and not tgt.any()
            w.add(1)
            await asyncio.wait_for(asyncio.gather(first, relay), 30)
            await e0.expect_imm(back, pages, timeout=30)
            assert sha(cp.asnumpy(tgt)) == sha(h)
            assert sha(cp.asnumpy(back_buf)) == sha(h.reshape(pages, page)[::-1].reshape(-1))
        finally:
            await e0.aclose()
            await e1.aclose()

    asyncio.run(main())


def reforge(blob: bytes, length: int) -> bytes:
    """Rewrite a descriptor's length and fix its checksum, as an attacker could."""
    addr_len = struct.unpack_from("<I", blob, 4)[0]
    off = 8 + addr_len + 8
    body = bytearray(blob[:-4])
    struct.pack_into("<Q", body, off, length)
    return bytes(body) + struct.pack("<I", zlib.crc32(bytes(body)))


@TARGETS
def test_bad_input(dst: int) -> None:
    cp = _cp(dst)

    async def main() -> None:
        e0, e1 = await _engines(dst)
        try:
            with cp.cuda.Device(dst):
                whole = cp.zeros(8192, dtype=cp.uint8)  # region = first half, canary = second
                whole[4096:] = 0x5A
            with cp.cuda.Device(0):
                src = cp.full(8192, 7, dtype=cp.uint8)
            tmr = e1.register_ptr(int(whole.data.ptr), 4096, device=dst, owner=whole)
            smr = e0.register(src, remote=False)
            imm = e1.alloc_imm()
            # host memory cannot be a target, and says so
            with pytest.raises(errors.RegistrationError, match="host memory"):
                e1.register(np.zeros(64, dtype=np.uint8))
            # ranges, immediates and pages are checked before anything is posted
            with pytest.raises(errors.OutOfRange):
                await e0.write(smr, tmr.descriptor, 4097)
            with pytest.raises(errors.OutOfRange):
                await e0.write(smr, tmr.descriptor, 16, dst_offset=4090)
            with pytest.raises(errors.ImmediateOutOfRange):
                await e0.write(smr, tmr.descriptor, 8, imm=1 << 32)
            with pytest.raises(errors.OutOfRange):
                await e0.write_paged(smr, tmr.descriptor, page_len=64, src_pages=afabric.Pages([0], 64),
                                     dst_pages=afabric.Pages([64], 64), imm=imm)  # fmt: skip
            # a forged length passes the local checks; the target's export table refuses it
            forged = afabric.MrDesc.from_bytes(reforge(bytes(tmr.descriptor), 8192))
            with pytest.raises(errors.RemoteKeyRejected):
                await asyncio.wait_for(e0.write(smr, forged, 8192, imm=imm), 30)
            with pytest.raises(errors.RemoteKeyRejected):
                p0, p1 = afabric.Pages([0], 4096), afabric.Pages([1], 4096)
                w = e0.write_paged(smr, forged, page_len=4096, src_pages=p0, dst_pages=p1, imm=imm)
                await asyncio.wait_for(w, 30)
            # a deregistered region is refused at once, even with the descriptor imported
            desc = tmr.descriptor
            await e0.write(smr, desc, 8)
            whole[:8] = 0
            e1.deregister(tmr)
            with pytest.raises(errors.RemoteKeyRejected):
                await asyncio.wait_for(e0.write(smr, desc, 4096, imm=imm), 30)
            with pytest.raises(errors.OperationTimeout):  # no arrival was counted
                await e1.expect_imm(imm, 1, timeout=0.3)
            host = cp.asnumpy(whole)
            assert not host[:4096].any() and (host[4096:] == 0x5A).all(), "refused writes left bytes"
        finally:
            await e0.aclose()
            await e1.aclose()

    asyncio.run(main())


# ---- without CUDA ----


def test_unavailable_without_cuda_is_clean() -> None:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        pass
    else:
        pytest.skip("the CUDA driver is present here")
    avail = registry.probe(PROVIDER)
    assert not avail.available
    assert "libcuda" in avail.reason and "hint" in avail.reason, avail.reason

    async def main() -> None:
        with pytest.raises(errors.ProviderUnavailable, match="libcuda"):
            afabric.Engine(PROVIDER)

    asyncio.run(main())


if __name__ == "__main__":
    asyncio.run(_peer_main(int(sys.argv[1]), int(sys.argv[2])))
