"""afabric.compat.mooncake: Mooncake's own initiator tests (unmodified, from
../shared/peersuite when present) against its target through the alias distribution
compat/mooncake, and what that suite does not cover: many threads, notifications after their
data, a peer killed mid-transfer, fork, collection and Mooncake's return codes.

Targets are real processes (tests/mooncake_peer.py or Mooncake's own target script); the
initiator under test lives in this process unless the upstream suite runs it.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import hashlib
import http.server
import json
import os
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
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from afabric.compat import _core
from afabric.compat.mooncake import (
    ERR_ADDRESS_NOT_REGISTERED,
    ERR_ADDRESS_OVERLAPPED,
    ERR_METADATA,
    TransferEngine,
    TransferNotify,
    TransferOpcode,
)

ROOT = Path(__file__).resolve().parents[1]
PEER = ROOT / "tests" / "mooncake_peer.py"
PEERSUITE = next(
    (p for p in (ROOT.parent / "shared/peersuite/mooncake", ROOT.parent.parent / "shared/peersuite/mooncake")
     if (p / "tests/transfer_engine_initiator_test.py").is_file()),
    None,
)  # fmt: skip
NAME_A, NAME_B = "127.0.0.1:7005", "127.0.0.1:7006"  # segment names of test_return_codes


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_port(port: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port}")


def _stop(proc: subprocess.Popen[str]) -> None:
    """End a child so that it closes its engines (a cma engine's segment in /dev/shm goes
    with them): SIGINT (Mooncake's target spins in `while True: pass`), SIGKILL if it stays."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait(30)


class _Lines:
    """Lines of a child's stdout, read by a thread so that a wait can time out."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.q: queue.Queue[str] = queue.Queue()
        assert proc.stdout is not None
        out = proc.stdout
        threading.Thread(target=lambda: [self.q.put(line) for line in out], daemon=True).start()

    def get(self, timeout: float = 60.0) -> str:
        return self.q.get(timeout=timeout)


class Peer:
    """tests/mooncake_peer.py in its own process."""

    def __init__(self, server: str = "P2PHANDSHAKE", size: int = 4 << 20, name: str = "127.0.0.1",
                 provider: str = "tcp") -> None:  # fmt: skip
        env = {**os.environ, "AFABRIC_COMPAT_PROVIDER": provider, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, str(PEER), server, str(size), name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        self.lines = _Lines(self.proc)
        ready = json.loads(self.lines.get())
        assert "error" not in ready, ready
        self.name: str = ready["name"]
        self.addr: int = ready["addr"]

    def tell(self, cmd: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout: float = 60.0) -> dict[str, Any]:
        got: dict[str, Any] = json.loads(self.lines.get(timeout))
        return got

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.tell({"cmd": "exit"})
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(30)
        _stop(self.proc)


@pytest.fixture
def peer_factory() -> Iterator[Any]:
    made: list[Peer] = []

    def make(**kw: Any) -> Peer:
        p = Peer(**kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close()


@pytest.fixture
def engines() -> Iterator[Any]:
    """TransferEngines of this process, closed after the test."""
    made: list[TransferEngine] = []

    def make(server: str = "P2PHANDSHAKE", name: str = "127.0.0.1") -> TransferEngine:
        te = TransferEngine()
        assert te.initialize(name, server, "tcp", "") == 0
        made.append(te)
        return te

    yield make
    for te in made:
        te.close()


class _MetadataHandler(http.server.BaseHTTPRequestHandler):
    """Mooncake's HTTP metadata protocol (GET/PUT/DELETE of ?key=; a second PUT of an
    rpc_meta key is refused), in the standard library, for tests that do not need the
    peer suite's aiohttp server."""

    store: dict[str, bytes]

    def _key(self) -> str:
        from urllib.parse import parse_qs, urlparse

        return parse_qs(urlparse(self.path).query).get("key", [""])[0]

    def _reply(self, status: int, body: bytes = b"") -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        value = self.store.get(self._key())
        self._reply(404) if value is None else self._reply(200, value)

    def do_PUT(self) -> None:
        key, body = self._key(), self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if "rpc_meta" in key and key in self.store:
            self._reply(400)
            return
        self.store[key] = body
        self._reply(200)

    def do_DELETE(self) -> None:
        self._reply(404) if self.store.pop(self._key(), None) is None else self._reply(200)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def metadata_server() -> Iterator[tuple[str, dict[str, bytes]]]:
    store: dict[str, bytes] = {}
    handler = type("H", (_MetadataHandler,), {"store": store})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}/metadata", store
    srv.shutdown()
    srv.server_close()


# ---- Mooncake's own tests ----


@pytest.fixture(scope="module")
def alias_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip install ./compat/mooncake` into a folder of its own (never into the test
    environment, where Mooncake's own `mooncake` package may be installed for benchmarks)."""
    tmp = tmp_path_factory.mktemp("mooncake_alias")
    shutil.copytree(ROOT / "compat/mooncake", tmp / "src")  # builds in a copy, not the tree
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(tmp / "site"), str(tmp / "src")],
        check=True, timeout=300,
    )  # fmt: skip
    return tmp / "site"


def test_alias_installs_mooncake_engine(alias_site: Path) -> None:
    code = "import mooncake.engine as m; print(m.TransferEngine.__module__)"
    env = {**os.environ, "PYTHONPATH": str(alias_site)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "afabric.compat.mooncake"


def _upstream(alias_site: Path, env: dict[str, str]) -> str:
    """Mooncake's target script, then its initiator's tests (CIRCLE=50); their output."""
    assert PEERSUITE is not None
    env = {**os.environ, "PYTHONPATH": str(alias_site), "PYTHONUNBUFFERED": "1", "CIRCLE": "50", **env}
    target = subprocess.Popen(
        [sys.executable, str(PEERSUITE / "tests/transfer_engine_target.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        lines = _Lines(target)
        while "Target server ready" not in (line := lines.get(60)):
            assert "Error" not in line, line
        run = subprocess.run(
            [sys.executable, str(PEERSUITE / "tests/transfer_engine_initiator_test.py")],
            check=False, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    finally:
        _stop(target)
    return run.stderr + run.stdout


@pytest.mark.skipif(PEERSUITE is None, reason="../shared/peersuite is not present")
def test_upstream_suite_http_metadata_tcp(alias_site: Path) -> None:
    """Upstream's recipe: its aiohttp metadata server, MC_FORCE_TCP, its target, CIRCLE=50."""
    pytest.importorskip("aiohttp", reason="Mooncake's metadata server needs aiohttp (the test extra has it)")
    assert PEERSUITE is not None
    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, str(PEERSUITE / "mooncake/http_metadata_server.py"), "--port", str(port),
         "--host", "127.0.0.1", "--log-level", "WARNING"],
    )  # fmt: skip
    try:
        _wait_port(port)
        out = _upstream(
            alias_site,
            {"MC_METADATA_SERVER": f"http://127.0.0.1:{port}/metadata", "MC_FORCE_TCP": "true",
             "AFABRIC_COMPAT_PROVIDER": ""},
        )  # fmt: skip
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert re.search(r"Ran 6 tests in [\d.]+s\s+OK\b", out), out


@pytest.mark.skipif(PEERSUITE is None, reason="../shared/peersuite is not present")
def test_upstream_suite_p2p_handshake_cma(alias_site: Path) -> None:
    """The same tests with P2PHANDSHAKE (listeners on the names' ports) over cma."""
    target, initiator = _free_port(), _free_port()
    out = _upstream(
        alias_site,
        {"MC_METADATA_SERVER": "P2PHANDSHAKE", "MC_LEGACY_RPC_PORT_BINDING": "1",
         "TARGET_SERVER_NAME": f"127.0.0.1:{target}", "INITIATOR_SERVER_NAME": f"127.0.0.1:{initiator}",
         "AFABRIC_COMPAT_PROVIDER": "cma"},
    )  # fmt: skip
    assert re.search(r"Ran 6 tests in [\d.]+s\s+OK\b", out), out


# ---- what the suite does not cover ----


def test_ten_threads_batch_writes(peer_factory: Any, engines: Any) -> None:
    """vLLM's pattern: 10 threads x 100 batch_transfer_sync_write to one peer, each batch's
    bytes read back and compared."""
    peer = peer_factory(size=10 * 64 * 1024)
    te = engines()
    src = te.allocate_managed_buffer(10 * 2 * 64 * 1024)
    failures: list[str] = []

    def worker(i: int) -> None:
        rnd = random.Random(i)
        mine, back = src + i * 128 * 1024, src + i * 128 * 1024 + 64 * 1024
        remote = peer.addr + i * 64 * 1024
        for it in range(100):
            lens = [rnd.randint(1, 4096) for _ in range(8)]
            offs = [j * 8192 for j in range(8)]
            data = [rnd.randbytes(n) for n in lens]
            for off, d in zip(offs, data, strict=True):
                ctypes.memmove(mine + off, d, len(d))
            remotes = [remote + o for o in offs]
            rc = te.batch_transfer_sync_write(peer.name, [mine + o for o in offs], remotes, lens)
            if rc != 0:
                failures.append(f"thread {i} write {it}: {rc}")
                return
            ctypes.memset(back, 0, 64 * 1024)
            rc = te.batch_transfer_sync_read(peer.name, [back + o for o in offs], remotes, lens)
            got = [ctypes.string_at(back + o, n) for o, n in zip(offs, lens, strict=True)]
            if rc != 0 or got != data:
                failures.append(f"thread {i} read {it}: rc {rc}, equal {got == data}")
                return

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(100)
    assert not any(t.is_alive() for t in threads), "a thread is still inside a call"
    assert failures == []


@pytest.mark.parametrize("provider", ["tcp", "cma"])
def test_notification_after_data(provider: str, peer_factory: Any, engines: Any,
                                  monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    """transfer_sync(..., notify=): when the target's get_notifies() returns it, the data of
    its transfer is in the target's memory (random sizes, 1 B .. 32 MiB: a notification sent
    with its data rather than after it overtakes the large ones, and the target, polling in a
    tight loop, sees their bytes missing)."""
    monkeypatch.setenv("AFABRIC_COMPAT_PROVIDER", provider)
    rnd = random.Random(7)
    sizes = [rnd.choice([1, rnd.randint(2, 4096), rnd.randint(4097, 1 << 20)]) for _ in range(16)]
    sizes += [rnd.randint(4 << 20, 32 << 20) for _ in range(4)]
    rnd.shuffle(sizes)
    peer = peer_factory(size=sum(sizes), provider=provider)
    te = engines()
    src = te.allocate_managed_buffer(max(sizes))
    peer.tell({"cmd": "notifies", "count": len(sizes), "timeout": 60})  # it polls from now on
    off = 0
    for i, n in enumerate(sizes):
        data = rnd.randbytes(n)
        ctypes.memmove(src, data, n)
        sha, tail = hashlib.sha256(data).hexdigest(), data[-16:].hex()
        msg = json.dumps({"off": off, "len": n, "sha": sha, "tail": tail})
        note = TransferNotify(f"t{i}", msg)
        assert te.transfer_sync(peer.name, src, peer.addr + off, n, TransferOpcode.Write, note) == 0
        off += n
    got = peer.reply()
    assert got["checked"] == len(sizes) and got["bad"] == []
    assert sorted(got["names"]) == sorted(f"t{i}" for i in range(len(sizes)))


def test_peer_killed_mid_transfer(peer_factory: Any, engines: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A target killed while a batch of 16 MiB writes is in flight: the call returns a
    negative code (within op_timeout, MC_TRANSFER_TIMEOUT=5 s), never hangs; later calls to
    it fail at once."""
    monkeypatch.setenv("MC_TRANSFER_TIMEOUT", "5")
    peer = peer_factory(size=64 << 20)
    te = engines()
    src = te.allocate_managed_buffer(16 << 20)
    assert te.transfer_sync_write(peer.name, src, peer.addr, 4096) == 0
    results: list[tuple[int, float]] = []
    started = threading.Event()

    def writer() -> None:
        for _ in range(1000):
            started.set()
            t0 = time.monotonic()
            rc = te.batch_transfer_sync_write(
                peer.name, [src] * 4, [peer.addr + k * (16 << 20) for k in range(4)], [16 << 20] * 4
            )
            results.append((rc, time.monotonic() - t0))
            if rc != 0:
                return

    t = threading.Thread(target=writer)
    t.start()
    assert started.wait(30)
    time.sleep(0.2)
    peer.proc.send_signal(signal.SIGKILL)
    peer.proc.wait(30)
    t.join(120)
    assert not t.is_alive(), "the call did not return"
    rc, took = results[-1]
    assert rc < 0
    assert took < 5 + _core.DEADLINE_SLACK_S + 64 / 100 + 30  # the deadline, and room for a loaded box
    assert te.transfer_sync_write(peer.name, src, peer.addr, 4096) < 0


def test_import_starts_no_thread() -> None:
    code = (
        "import threading, afabric.compat, afabric.compat.mooncake;"
        "print(threading.active_count(), [t.name for t in threading.enumerate()])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("1 "), out.stdout


def test_agent_made_after_fork(peer_factory: Any, engines: Any) -> None:
    """A child forked from a process whose loop thread runs makes its own agent and
    transfers; the agent it inherited refuses work (-1) instead of hanging."""
    peer = peer_factory()
    te = engines()
    src = te.allocate_managed_buffer(4096)
    assert te.transfer_sync_write(peer.name, src, peer.addr, 16) == 0
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what failed
        code = 1
        try:
            if te.transfer_sync_write(peer.name, src, peer.addr, 16) >= 0:
                code = 2
            else:
                mine = TransferEngine()
                if mine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") != 0:
                    code = 3
                else:
                    buf = mine.allocate_managed_buffer(4096)
                    ctypes.memmove(buf, b"from the child", 14)
                    ok = mine.transfer_sync_write(peer.name, buf, peer.addr + 100, 14) == 0
                    ctypes.memset(buf, 0, 14)
                    ok = ok and mine.transfer_sync_read(peer.name, buf, peer.addr + 100, 14) == 0
                    code = 0 if ok and ctypes.string_at(buf, 14) == b"from the child" else 4
                    mine.close()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(status) == 0
    assert te.transfer_sync_write(peer.name, src, peer.addr, 16) == 0  # the parent's still works


def _port_free(port: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
                return True
            except OSError:
                time.sleep(0.05)
    return False


def test_close_and_collection_release_engine_port_and_metadata(metadata_server: Any) -> None:
    """close(), and dropping the last reference, release the engine, the listener's port and
    the metadata entries."""
    url, store = metadata_server
    rt_open = len(_core.runtime()._open)
    te = TransferEngine()
    assert te.initialize("127.0.0.1:7001", url, "tcp", "") == 0
    port = te.get_rpc_port()
    assert "mooncake/rpc_meta/127.0.0.1:7001" in store and "mooncake/ram/127.0.0.1:7001" in store
    te.close()
    assert _port_free(port) and len(_core.runtime()._open) == rt_open
    assert "mooncake/rpc_meta/127.0.0.1:7001" not in store and "mooncake/ram/127.0.0.1:7001" not in store

    other = TransferEngine()
    assert other.initialize("127.0.0.1:7008", url, "tcp", "") == 0
    dst = other.allocate_managed_buffer(4096)
    te = TransferEngine()
    assert te.initialize("127.0.0.1:7002", url, "tcp", "") == 0
    src = te.allocate_managed_buffer(4096)
    assert te.transfer_sync_write("127.0.0.1:7008", src, dst, 64) == 0  # other is in its peer table
    port = te.get_rpc_port()
    gc.disable()  # reference counting alone frees it: nothing of it is in a cycle
    try:
        del te
        assert _port_free(port)
    finally:
        gc.enable()
    other.close()
    deadline = time.monotonic() + 30
    while len(_core.runtime()._open) != rt_open and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(_core.runtime()._open) == rt_open
    assert "mooncake/rpc_meta/127.0.0.1:7002" not in store


def test_a_live_agents_name_is_refused_a_dead_ones_reclaimed(metadata_server: Any) -> None:
    url, store = metadata_server
    first = TransferEngine()
    assert first.initialize("127.0.0.1:7003", url, "tcp", "") == 0
    assert TransferEngine().initialize("127.0.0.1:7003", url, "tcp", "") == -1
    dead = {"ip_or_host_name": "127.0.0.1", "rpc_port": _free_port()}  # nothing listens there
    store["mooncake/rpc_meta/127.0.0.1:7004"] = json.dumps(dead).encode()
    second = TransferEngine()
    assert second.initialize("127.0.0.1:7004", url, "tcp", "") == 0
    first.close()
    second.close()


def test_return_codes(engines: Any, metadata_server: Any) -> None:
    url, _ = metadata_server
    a, b = engines(url, NAME_A), engines(url, NAME_B)
    assert TransferEngine().initialize("x", "etcd://127.0.0.1:2379", "tcp", "") == -1
    assert TransferEngine().initialize("x", "P2PHANDSHAKE", "infiniband", "") == -1
    with pytest.raises(NotImplementedError, match="Mooncake Store is out of scope"):
        a.get_engine()
    mem = ctypes.create_string_buffer(1 << 16)
    base = ctypes.addressof(mem)
    assert a.register_memory(base, 1 << 15) == 0
    assert a.register_memory(base + 100, 10) == ERR_ADDRESS_OVERLAPPED
    assert a.batch_register_memory([base + (1 << 15)], [1 << 15]) == 0
    assert a.get_first_buffer_address(NAME_A) == base
    dst = b.allocate_managed_buffer(1 << 16)
    assert a.get_first_buffer_address(NAME_B) == dst
    assert a.send_probe(NAME_B) == 0 and a.send_probe("nobody") == ERR_METADATA
    # a range past the peer's buffer, an unregistered source, columns of different lengths
    assert a.transfer_sync_write(NAME_B, base, dst + (1 << 16) - 8, 16) == -1
    assert a.transfer_sync_write(NAME_B, base - 4096, dst, 16) == -1
    assert a.batch_transfer_sync_write(NAME_B, [base, base], [dst], [8, 8]) == -1
    assert a.batch_transfer_async_write(NAME_B, [base], [dst + (1 << 20)], [8]) == 0
    # the peer registers more memory: the initiator's table misses, refreshes once, succeeds
    more = ctypes.create_string_buffer(4096)
    assert b.register_memory(ctypes.addressof(more), 4096) == 0
    ctypes.memmove(base, b"refreshed", 9)
    assert a.transfer_sync_write(NAME_B, base, ctypes.addressof(more), 9) == 0
    assert more.raw[:9] == b"refreshed"
    batch = a.transfer_submit_write(NAME_B, base, dst, 64)
    assert batch != 0
    while (st := a.transfer_check_status(batch)) == 0:
        pass
    assert st == 1 and a.transfer_check_status(batch) == -1  # spent
    ids = [a.batch_transfer_async_read(NAME_B, [base + 64 * k], [dst], [64]) for k in range(3)]
    assert 0 not in ids and a.get_batch_transfer_status(ids) == 0
    assert a.get_batch_transfer_status(ids) == -1  # spent
    assert a.write_bytes_to_buffer(base, b"abc", 3) == 0 and a.read_bytes_from_buffer(base, 3) == b"abc"
    assert a.write_bytes_to_buffer(base, b"abc", 4) == -1
    assert a.free_managed_buffer(base, 10) == -1
    assert b.free_managed_buffer(dst, 1 << 16) == 0
    assert a.unregister_memory(base + 1) == ERR_ADDRESS_NOT_REGISTERED
    assert a.batch_unregister_memory([base, base + (1 << 15)]) == 0
    assert a.get_first_buffer_address(NAME_A) == 0
    assert json.loads(a.get_local_topology())  # the NICs of its provider, by NUMA node


def test_bench_compat_smoke() -> None:
    """`afabric bench compat` runs a tiny workload through afabric's column and checks the
    bytes; Mooncake's column runs or says why it is skipped."""
    cmd = [sys.executable, "-m", "afabric.cli", "bench", "compat", "--sizes", "64K", "--batch-bytes", "128K",
           "--iterations", "1", "--json", "-"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    doc = json.loads(out.stdout)
    ours = doc["results"]["afabric-mooncake"]
    assert ours["checked"] is True and ours["sizes"]["65536"]["writes_per_batch"] == 2
    real = doc["results"]["mooncake"]
    assert real.get("checked") is True or "Mooncake" in real["skipped"]
