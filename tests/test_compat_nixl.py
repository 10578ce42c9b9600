"""afabric.compat.nixl: NIXL's own Python tests (unmodified, from ../shared/peersuite when
present) through the alias distribution compat/nixl, and what they do not cover: a
notification seen only after its transfer's data (WRITE and READ, tcp and cma, a target in
another process), a peer killed mid-transfer, vLLM's READ of 12,800 block descriptors as a
few afabric operations, fork, closing and collection, the listener, partial metadata,
descriptor lists and errors.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import pickle
import queue
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from afabric.compat import _core
from afabric.compat.nixl import _bindings as nb
from afabric.compat.nixl import nixl_agent, nixl_agent_config

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "nixl_peer.py"
PEERSUITE = next(
    (p for p in (ROOT.parent / "shared/peersuite/nixl", ROOT.parent.parent / "shared/peersuite/nixl")
     if (p / "test/python/test_nixl_api.py").is_file()),
    None,
)  # fmt: skip
DEADLINE = 60.0  # generous: the 2-core machine runs other suites beside this one


def _wait(what: str, cond: Callable[[], Any], timeout: float = DEADLINE) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(0.001)
    raise TimeoutError(f"{what}: not within {timeout} s")


def _done(agent: nixl_agent, handle: Any) -> None:
    _wait("transfer", lambda: agent.check_xfer_state(handle) == "DONE")


@pytest.fixture
def agents(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., nixl_agent]]:
    """Agents made in this process (provider "tcp" unless given), closed at teardown."""
    made: list[nixl_agent] = []

    def make(name: str | None = None, provider: str = "tcp", **conf: Any) -> nixl_agent:
        monkeypatch.setenv("AFABRIC_COMPAT_PROVIDER", provider)
        a = nixl_agent(
            name or f"a{len(made)}-{os.getpid()}", nixl_agent_config(**{"backends": ["UCX"], **conf})
        )
        made.append(a)
        return a

    yield make
    for a in made:
        a.close()


class Peer:
    """tests/nixl_peer.py in its own process."""

    def __init__(self, name: str, size: int, provider: str) -> None:
        env = {**os.environ, "AFABRIC_COMPAT_PROVIDER": provider, "PYTHONPATH": str(ROOT)}
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), name, str(size)],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        hello = self.line()
        self.md, self.addr = bytes.fromhex(hello["md"]), int(hello["addr"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)

    def line(self) -> dict[str, Any]:
        try:
            return json.loads(self._lines.get(timeout=DEADLINE))  # type: ignore[no-any-return]
        except queue.Empty:
            raise TimeoutError(f"peer {self.name} said nothing for {DEADLINE} s") from None

    def meet(self, agent: nixl_agent) -> None:
        assert agent.add_remote_agent(self.md) == self.name.encode()
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"md": agent.get_agent_metadata().hex()}) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """Let it exit by itself (it closes its engine) if it is on its way, else kill it;
        remove the /dev/shm files (a cma engine's segment) a killed one left behind."""
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.kill()
        for f in Path("/dev/shm").glob(f"{self.proc.pid}:*"):
            f.unlink(missing_ok=True)


@pytest.fixture
def peer() -> Iterator[Callable[..., Peer]]:
    started: list[Peer] = []

    def start(size: int, provider: str = "tcp") -> Peer:
        p = Peer(f"target-{len(started)}-{os.getpid()}", size, provider)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()


def _pattern(seq: int, size: int) -> np.ndarray:
    return np.random.default_rng(seq).integers(0, 256, size, dtype=np.uint8)


# ---- upstream's suite and the alias distribution ----


@pytest.fixture(scope="module")
def alias_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install ./compat/nixl` into a folder of its own: never into the test environment,
    where NIXL's own wheel (which imports as `nixl` too) may be installed for benchmarks."""
    tmp = tmp_path_factory.mktemp("nixl_alias")
    shutil.copytree(ROOT / "compat/nixl", tmp / "src")  # builds in a copy, not the tree
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(tmp / "site"), str(tmp / "src")],
        check=True, timeout=300,
    )  # fmt: skip
    return tmp / "site"


def test_alias_installs_nixl_modules_and_import_starts_no_thread(alias_site: Path) -> None:
    code = (
        "import threading, sys\n"
        "import nixl, nixl._api, nixl._bindings, nixl._utils, nixl.logging\n"
        "import afabric.compat.nixl._bindings as b\n"
        "assert nixl._bindings is b and sys.modules['nixl._api'] is nixl._api\n"
        "assert nixl._api.nixl_agent is nixl.nixl_agent\n"
        "print(threading.active_count(), nixl._api.nixl_agent.__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{alias_site}{os.pathsep}{ROOT}"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "afabric.compat.nixl._api"]


@pytest.mark.skipif(PEERSUITE is None, reason="../shared/peersuite is not present")
def test_upstream_suite(alias_site: Path, tmp_path: Path) -> None:
    """NIXL's test/python, unmodified (run from a copy), as upstream runs it: >= 24 passed, none failed."""
    assert PEERSUITE is not None
    pytest.importorskip("torch", reason="NIXL's tests need torch (CPU)")
    pytest.importorskip("pytest_timeout", reason="NIXL's tests need pytest-timeout")
    suite = tmp_path / "nixl"
    shutil.copytree(PEERSUITE, suite)
    env = {**os.environ, "PYTHONPATH": f"{alias_site}{os.pathsep}{ROOT}", "AFABRIC_COMPAT_PROVIDER": ""}
    for var in ("NIXL_TELEMETRY_ENABLE", "NIXL_TELEMETRY_DIR"):
        env.pop(var, None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test/python"],
        cwd=suite, env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    out = run.stdout + run.stderr
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) >= 24, out
    assert not re.search(r"\d+ (failed|error)", out), out
    assert run.returncode == 0, out


# ---- notifications come after their data ----


@pytest.mark.parametrize("provider", ["tcp", "cma"])
def test_notification_after_data(
    provider: str, agents: Callable[..., nixl_agent], peer: Callable[..., Peer]
) -> None:
    """WRITEs of random sizes into a target process, several in flight: the target hashes
    each write's bytes the moment its notification shows and finds them all there. READs:
    the target overwrites its buffer as soon as a read's notification shows, and every read
    still returned the bytes from before."""
    rnd = random.Random(7)
    sizes = [rnd.choice((1, 7, 4096, 65536 + 3, 300_000)) for _ in range(24)]
    size = sum(sizes)
    target = peer(size, provider)
    me = agents(provider=provider)
    target.meet(me)
    src = np.frombuffer(rnd.randbytes(size), dtype=np.uint8).copy()
    me.register_memory([(int(src.ctypes.data), size, 0, "")], "DRAM")
    handles, off = [], 0
    for n in sizes:
        local = me.get_xfer_descs([(int(src.ctypes.data) + off, n, 0)], "DRAM")
        remote = me.get_xfer_descs([(target.addr + off, n, 0)], "DRAM")
        sha = hashlib.sha256(src[off : off + n].tobytes()).hexdigest()
        h = me.initialize_xfer("WRITE", local, remote, target.name, f"W {off} {n} {sha}".encode())
        assert me.transfer(h) in ("PROC", "DONE")
        handles.append(h)
        off += n
        if len(handles) == 4:  # a few in flight at once
            for h in handles:
                _done(me, h)
            handles = []
    for h in handles:
        _done(me, h)

    dst = np.zeros(size, dtype=np.uint8)
    me.register_memory([(int(dst.ctypes.data), size, 0, "")], "DRAM")
    for seq in range(6):
        me.send_notif(target.name, f"P {seq}".encode())
        _wait("target ready", lambda seq=seq: me.check_remote_xfer_done(target.name, f"ready {seq}".encode()))
        n = rnd.randrange(1, size)
        start = rnd.randrange(0, size - n + 1)
        local = me.get_xfer_descs([(int(dst.ctypes.data) + start, n, 0)], "DRAM")
        remote = me.get_xfer_descs([(target.addr + start, n, 0)], "DRAM")
        h = me.initialize_xfer("READ", local, remote, target.name, f"R {seq}".encode())
        me.transfer(h)
        _done(me, h)
        assert np.array_equal(dst[start : start + n], _pattern(seq, size)[start : start + n]), f"read {seq}"
    me.send_notif(target.name, b"END")
    result = target.line()
    assert result == {"checked": len(sizes), "bad": []}


# ---- failures ----


@pytest.mark.parametrize("provider", ["tcp", "cma"])
def test_peer_killed_mid_transfer(
    provider: str, agents: Callable[..., nixl_agent], peer: Callable[..., Peer]
) -> None:
    """Kill the target while 32 MiB writes are in flight: the transfer reports
    nixlRemoteDisconnectError within op_timeout (never hangs), and the agent forgets it."""
    size = 32 << 20
    target = peer(size, provider)
    me = agents(provider=provider)
    target.meet(me)
    src = np.ones(size, dtype=np.uint8)
    me.register_memory([(int(src.ctypes.data), size, 0, "")], "DRAM")
    local = me.get_xfer_descs([(int(src.ctypes.data), size, 0)], "DRAM")
    remote = me.get_xfer_descs([(target.addr, size, 0)], "DRAM")
    h = me.initialize_xfer("WRITE", local, remote, target.name)
    me.transfer(h)
    _done(me, h)  # one went through
    me.transfer(h)  # repost after DONE
    target.kill()
    t0 = time.monotonic()
    with pytest.raises(nb.nixlRemoteDisconnectError):
        while True:
            if me.check_xfer_state(h) == "DONE":
                me.transfer(h)
            assert time.monotonic() - t0 < _core.DEADLINE_SLACK_S + 20.0 + 30.0, "no error: hung"
            time.sleep(0.001)
    assert time.monotonic() - t0 < 20.0 + 30.0  # op_timeout (20 s) and slack for a loaded machine
    assert not me.check_remote_metadata(target.name)
    with pytest.raises(nb.nixlNotFoundError):
        me.transfer(h)


def test_metadata_errors_and_unknown_backends(agents: Callable[..., nixl_agent]) -> None:
    a = agents()
    with pytest.raises(nb.nixlNotFoundError):
        a.create_backend("UVX")
    with pytest.raises(nb.nixlInvalidParamError):
        a.create_backend("UCX")  # already there
    md = a.get_agent_metadata()
    b = agents(backends=["LIBFABRIC"])
    rnd = random.Random(3)
    for _ in range(200):
        bad = bytearray(md)
        for _ in range(rnd.randrange(1, 4)):
            bad[rnd.randrange(len(bad))] = rnd.randrange(256)
        blob = bytes(bad[: rnd.randrange(len(bad) + 1)])
        with contextlib.suppress(
            nb.nixlMismatchError, nb.nixlBackendError, nb.nixlInvalidParamError, nb.nixlNotAllowedError
        ):
            b.add_remote_agent(blob)
        b.remove_remote_agent(a.name)
    with pytest.raises(nb.nixlInvalidParamError):
        a.add_remote_agent(md)  # its own
    assert b.add_remote_agent(md) == a.name.encode()  # UCX and LIBFABRIC are the same transport
    assert b.check_remote_metadata(a.name)
    empty = nixl_agent(f"empty-{os.getpid()}", nixl_agent_config(backends=[]))
    with pytest.raises(nb.nixlInvalidParamError):
        empty.get_agent_metadata()
    with pytest.raises(nb.nixlBackendError):
        empty.get_new_notifs()


# ---- transfers ----


def _buffers(agent: nixl_agent, *sizes: int) -> list[np.ndarray]:
    out = []
    for n in sizes:
        buf = np.zeros(n, dtype=np.uint8)
        agent.register_memory([(int(buf.ctypes.data), n, 0, "")], "DRAM")
        out.append(buf)
    return out


def test_vllm_sized_read_posts_few_operations(agents: Callable[..., nixl_agent]) -> None:
    """vLLM's disaggregated-prefill READ: 64 layers x (K, V) regions, 100 random blocks of
    each, prepared once and read through make_prepped_xfer: 12,800 descriptors, and at most
    one afabric operation per local region."""
    regions, blocks, used, block_len = 128, 128, 100, 256
    decode, prefill = agents(), agents()
    prefill_kv = [
        np.frombuffer(random.Random(r).randbytes(blocks * block_len), np.uint8).copy() for r in range(regions)
    ]
    decode_kv = [np.zeros(blocks * block_len, np.uint8) for _ in range(regions)]
    for agent, kv in ((prefill, prefill_kv), (decode, decode_kv)):
        agent.register_memory([(int(t.ctypes.data), t.nbytes, 0, "") for t in kv], "DRAM")
    decode.add_remote_agent(prefill.get_agent_metadata())
    prefill.add_remote_agent(decode.get_agent_metadata())

    def block_descs(kv: list[np.ndarray]) -> np.ndarray:
        rows = np.zeros((regions * blocks, 3), dtype=np.uint64)
        base = np.array([int(t.ctypes.data) for t in kv], dtype=np.uint64)
        rows[:, 0] = (base[:, None] + np.arange(blocks, dtype=np.uint64) * block_len).ravel()
        rows[:, 1] = block_len
        return rows

    local = decode.prep_xfer_dlist("NIXL_INIT_AGENT", block_descs(decode_kv), "DRAM")
    remote = decode.prep_xfer_dlist(prefill.name, block_descs(prefill_kv), "DRAM")
    rng = np.random.default_rng(5)
    pick = np.concatenate([r * blocks + rng.permutation(blocks)[:used] for r in range(regions)])
    dest = np.concatenate([r * blocks + rng.permutation(blocks)[:used] for r in range(regions)])
    before = decode.agent.operations_posted()
    h = decode.make_prepped_xfer("READ", local, dest, remote, pick.astype(np.int32), b"req-1")
    decode.transfer(h)
    _done(decode, h)
    assert len(pick) == 12_800
    posted = decode.agent.operations_posted() - before
    assert 1 <= posted <= regions, f"{posted} afabric operations for {len(pick)} descriptors"
    for s, d in zip(pick.tolist(), dest.tolist(), strict=True):
        got = decode_kv[d // blocks][(d % blocks) * block_len : (d % blocks + 1) * block_len]
        want = prefill_kv[s // blocks][(s % blocks) * block_len : (s % blocks + 1) * block_len]
        assert np.array_equal(got, want), f"block {s} -> {d}"
    _wait("notification", lambda: prefill.check_remote_xfer_done(decode.name, b"req-1"))


def test_repost_loopback_telemetry_and_release(
    agents: Callable[..., nixl_agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handle posted again after DONE moves the data again (with a new notification);
    a loopback transfer (to the agent's own name) works; telemetry adds up."""
    monkeypatch.setenv("NIXL_TELEMETRY_ENABLE", "y")
    a = agents()
    src, dst = _buffers(a, 4096, 4096)
    local = a.get_xfer_descs([(int(src.ctypes.data), 1000, 0), (int(src.ctypes.data) + 2000, 24, 0)], "DRAM")
    remote = a.get_xfer_descs(
        [(int(dst.ctypes.data) + 8, 1000, 0), (int(dst.ctypes.data) + 3000, 24, 0)], "DRAM"
    )
    h = a.initialize_xfer("WRITE", local, remote, a.name, b"first")
    for k, note in enumerate((b"", b"second")):
        src[:] = k + 1
        a.transfer(h, note)
        _done(a, h)
        assert (dst[8:1008] == k + 1).all() and (dst[3000:3024] == k + 1).all()
    _wait("both notifications", lambda: a.update_notifs().get(a.name, []) == [b"first", b"second"])
    t = a.get_xfer_telemetry(h)
    assert (t.descCount, t.totalBytes) == (2, 1024) and t.xferDuration >= t.postDuration > 0
    a.release_xfer_handle(h)
    with pytest.raises(nb.nixlInvalidParamError):
        a.transfer(h)


def test_threads_share_an_agent(agents: Callable[..., nixl_agent]) -> None:
    """Eight threads post, poll and release transfers on one agent at once (vLLM calls from
    a thread pool): every transfer's bytes and notification arrive."""
    a, b = agents(), agents()
    src, back = _buffers(a, 8 * 4096, 8 * 4096)
    (dst,) = _buffers(b, 8 * 4096)
    a.add_remote_agent(b.get_agent_metadata())
    failures: list[str] = []

    def worker(t: int) -> None:
        rnd = random.Random(t)
        base = t * 4096
        try:
            for k in range(20):
                n = rnd.randrange(1, 4097)
                src[base : base + n] = rnd.randrange(256)
                pairs = [(a.get_xfer_descs([(int(x.ctypes.data) + base, n, 0)], "DRAM"),
                          a.get_xfer_descs([(int(dst.ctypes.data) + base, n, 0)], "DRAM"), op)
                         for x, op in ((src, "WRITE"), (back, "READ"))]  # fmt: skip
                for local, remote, op in pairs:
                    h = a.initialize_xfer(op, local, remote, b.name, f"{t}:{k}:{op}".encode())
                    a.transfer(h)
                    _done(a, h)
                    a.release_xfer_handle(h)
                if not np.array_equal(back[base : base + n], src[base : base + n]):
                    failures.append(f"thread {t} round {k}: bytes differ")
        except Exception as e:  # noqa: BLE001 - reported below
            failures.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(DEADLINE)
    assert not any(th.is_alive() for th in threads) and failures == []
    want = {f"{t}:{k}:{op}".encode() for t in range(8) for k in range(20) for op in ("WRITE", "READ")}
    got: set[bytes] = set()
    _wait("every notification", lambda: got.update(b.get_new_notifs().get(a.name, [])) or got == want)


def test_errors_before_posting(agents: Callable[..., nixl_agent]) -> None:
    a, b = agents(), agents()
    (src,) = _buffers(a, 4096)
    (dst,) = _buffers(b, 4096)
    a.add_remote_agent(b.get_agent_metadata())
    local = a.get_xfer_descs([(int(src.ctypes.data), 100, 0)], "DRAM")
    with pytest.raises(nb.nixlNotFoundError):  # not inside b's registrations
        a.initialize_xfer(
            "WRITE", local, a.get_xfer_descs([(int(dst.ctypes.data) + 4000, 100, 0)], "DRAM"), b.name
        )
    with pytest.raises(nb.nixlInvalidParamError):  # lengths differ
        a.initialize_xfer("WRITE", local, a.get_xfer_descs([(int(dst.ctypes.data), 99, 0)], "DRAM"), b.name)
    with pytest.raises(nb.nixlNotFoundError):  # unknown agent
        a.initialize_xfer("WRITE", local, local, "nobody")
    lp = a.prep_xfer_dlist("", local)
    rp = a.prep_xfer_dlist(b.name, a.get_xfer_descs([(int(dst.ctypes.data), 100, 0)], "DRAM"))
    with pytest.raises(nb.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", lp, [0], rp, [1])  # out of range
    with pytest.raises(nb.nixlInvalidParamError):
        a.make_prepped_xfer("WRITE", rp, [0], lp, [0])  # sides swapped
    h = a.make_prepped_xfer("WRITE", lp, [0], rp, [0])
    a.remove_remote_agent(b.name)
    with pytest.raises(nb.nixlNotFoundError):
        a.transfer(h)
    with pytest.raises(nb.nixlNotPostedError):
        a.check_xfer_state(h)
    reg = a.get_reg_descs([(int(src.ctypes.data), 4096, 0, "")], "DRAM")
    a.deregister_memory(reg)
    with pytest.raises(nb.nixlNotFoundError):  # deregistered: no longer a local side
        a.prep_xfer_dlist("", local)
    with pytest.raises(nb.nixlNotFoundError):  # and not twice
        a.deregister_memory(reg)


def test_listener_exchange_and_partial_metadata(agents: Callable[..., nixl_agent]) -> None:
    """send_local_metadata, fetch_remote_metadata and invalidate_local_metadata through the
    listeners (port 0: any free one); partial metadata adds regions to what is known."""
    a = agents(enable_listen_thread=True, listen_port=0)
    b = agents(enable_listen_thread=True, listen_port=0)
    port_a, port_b = (x.agent._endpoint.listener[1] for x in (a, b))  # type: ignore[union-attr]
    (src,) = _buffers(a, 4096)
    first, second = _buffers(b, 4096, 4096)
    b.send_local_metadata("127.0.0.1", port_a)
    _wait("pushed metadata", lambda: a.check_remote_metadata(b.name))
    b.invalidate_local_metadata("127.0.0.1", port_a)
    _wait("invalidation", lambda: not a.check_remote_metadata(b.name))
    a.fetch_remote_metadata(b.name, "127.0.0.1", port_b)
    assert a.check_remote_metadata(b.name, a.get_xfer_descs([(int(second.ctypes.data), 10, 0)], "DRAM"))
    a.remove_remote_agent(b.name)
    part = b.get_partial_agent_metadata(
        b.get_reg_descs([(int(first.ctypes.data), 4096, 0, "")], "DRAM"), True
    )
    a.add_remote_agent(part)
    only_first = a.get_xfer_descs([(int(second.ctypes.data), 10, 0)], "DRAM")
    assert a.check_remote_metadata(b.name) and not a.check_remote_metadata(b.name, only_first)
    a.add_remote_agent(
        b.get_partial_agent_metadata(b.get_reg_descs([(int(second.ctypes.data), 4096, 0, "")], "DRAM"))
    )
    assert a.check_remote_metadata(b.name, only_first)
    src[:] = 9
    h = a.initialize_xfer(
        "WRITE", a.get_xfer_descs([(int(src.ctypes.data), 10, 0)], "DRAM"), only_first, b.name
    )
    a.transfer(h)
    _done(a, h)
    assert (second[:10] == 9).all()


def test_descriptor_lists_from_every_form(agents: Callable[..., nixl_agent]) -> None:
    torch = pytest.importorskip("torch")
    a = agents(backends=[])
    rows = [(1000, 105, 0), (2000, 30, 0), (1010, 20, 0)]
    arr = np.array(rows, dtype=np.uint64)
    from_tuples, from_array = a.get_xfer_descs(rows, "DRAM"), a.get_xfer_descs(arr, "DRAM")
    assert from_tuples == from_array == pickle.loads(pickle.dumps(from_tuples))
    assert [from_array[i] for i in range(3)] == rows
    reg = a.get_reg_descs([(*r, b"meta") for r in rows], "DRAM")
    assert pickle.loads(a.get_serialized_descs(reg)) == reg and reg[0] == (1000, 105, 0, b"meta")
    assert reg.trim() == from_tuples
    t1, t2 = torch.arange(16, dtype=torch.float32), torch.zeros(8, dtype=torch.int64)
    from_tensors = a.get_xfer_descs([t1, t2])
    assert [from_tensors[i] for i in range(2)] == [(t1.data_ptr(), 64, 0), (t2.data_ptr(), 64, 0)]
    assert from_tensors.getType() == nb.DRAM_SEG
    with pytest.raises(ValueError):
        nb.nixlXferDList(nb.DRAM_SEG, np.zeros((2, 4), dtype=np.uint64))
    with pytest.raises(nb.nixlNotFoundError):
        from_tuples.index((1, 2, 3))


def test_bench_compat_nixl_columns() -> None:
    """`afabric bench compat`'s NIXL columns: afabric's moves and checks its batches and vLLM's
    12,800-descriptor READ; NIXL's own runs or says why it is skipped."""
    cmd = [sys.executable, "-m", "afabric.cli", "bench", "compat", "--systems", "nixl,afabric-nixl",
           "--sizes", "64K", "--batch-bytes", "128K", "--iterations", "1", "--json", "-"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    ours = doc["results"]["afabric-nixl"]
    assert ours["checked"] is True and ours["sizes"]["65536"]["writes_per_batch"] == 2
    assert ours["vllm_read"]["descriptors"] == 12_800 and ours["vllm_read"]["checked"] is True
    real = doc["results"]["nixl"]
    assert real.get("checked") is True or "NIXL" in real["skipped"]


# ---- lifetime ----


def test_close_and_collection_release_engine_and_port(agents: Callable[..., nixl_agent]) -> None:
    rt_open = lambda: len(_core.runtime()._open)  # noqa: E731 - engines open in this process
    base = rt_open()
    for close in (True, False):
        a = nixl_agent(
            f"life-{close}-{os.getpid()}", nixl_agent_config(enable_listen_thread=True, listen_port=0)
        )
        port = a.agent._endpoint.listener[1]  # type: ignore[union-attr]
        assert rt_open() == base + 1
        if close:
            a.close()
        del a
        gc.collect()
        _wait("engine closed", lambda: rt_open() == base)

        def free(port: int = port) -> bool:
            with socket.socket() as s:
                try:
                    s.bind(("0.0.0.0", port))
                except OSError:
                    return False
                return True

        _wait("listener port free", free)


def test_agent_made_after_fork_works(agents: Callable[..., nixl_agent]) -> None:
    parent = agents()  # the loop thread runs in this process before the fork
    pid = os.fork()
    if pid == 0:  # the child: a new agent, a loopback write, the exit status says how it went
        code = 1
        try:
            child = nixl_agent(f"child-{os.getpid()}", nixl_agent_config(backends=["UCX"]))
            src, dst = np.full(4096, 5, np.uint8), np.zeros(4096, np.uint8)
            child.register_memory([(int(x.ctypes.data), 4096, 0, "") for x in (src, dst)], "DRAM")
            h = child.initialize_xfer(
                "WRITE", child.get_xfer_descs([(int(src.ctypes.data), 4096, 0)], "DRAM"),
                child.get_xfer_descs([(int(dst.ctypes.data), 4096, 0)], "DRAM"), child.name,
            )  # fmt: skip
            child.transfer(h)
            _wait("child transfer", lambda: child.check_xfer_state(h) == "DONE", 30)
            code = 0 if (dst == 5).all() else 2
            child.close()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert parent.get_new_notifs() == {}  # the parent's agent is untouched by the child


# ---- GPU memory (the GPU machine) ----


def _cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


@pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA GPU")
def test_vram_segments_over_nvlink(agents: Callable[..., nixl_agent]) -> None:
    """VRAM registrations and a WRITE and a READ between them through the nvlink provider
    (two GPUs when there are two)."""
    import torch

    other = 1 if _cuda_devices() > 1 else 0
    a, b = agents(provider="nvlink"), agents(provider="nvlink")
    src = torch.arange(1 << 20, dtype=torch.uint8, device="cuda:0")
    dst = torch.zeros(1 << 20, dtype=torch.uint8, device=f"cuda:{other}")
    back = torch.zeros(1 << 20, dtype=torch.uint8, device="cuda:0")
    a.register_memory([src, back])
    b.register_memory(dst)
    a.add_remote_agent(b.get_agent_metadata())
    b.add_remote_agent(a.get_agent_metadata())
    h = a.initialize_xfer("WRITE", a.get_xfer_descs(src), a.get_xfer_descs(dst), b.name, b"vram")
    a.transfer(h)
    _done(a, h)
    _wait("notification", lambda: b.check_remote_xfer_done(a.name, b"vram"))
    assert torch.equal(dst.cpu(), src.cpu())
    h = a.initialize_xfer("READ", a.get_xfer_descs(back), a.get_xfer_descs(dst), b.name)
    a.transfer(h)
    _done(a, h)
    assert torch.equal(back.cpu(), src.cpu())
