"""libfabric's own benchmarks beside afabric's rows (`afabric bench p2p --fabtests DIR`).

`fi_rma_bw -o writedata` (RMA write with CQ data) and `fi_rdm_pingpong` from a fabtests
build (DIR holds the two binaries; libfabric v1.17's fabtests are what afabric's libfabric
paths are judged against). Each run is one server/client pair on this host through the
same libfabric provider afabric uses ("shm", "tcp;ofi_rxm"), the server's endpoint name
(shm) or port (tcp and the rest) its own, so pairs never collide. Nothing here asserts
speed: it reports what the C library reaches on this machine, beside afabric's numbers.
"""

from __future__ import annotations

import os
import random
import subprocess
import time
from pathlib import Path

RMA_BW = "fi_rma_bw"
PINGPONG = "fi_rdm_pingpong"
_TIMEOUT = 60.0  # one pair; a hung pair is retried (see _pair)
_ATTEMPTS = 3


class FabtestsError(RuntimeError):
    """A fabtests pair failed or printed no result line."""


class _Hung(FabtestsError):
    pass


def check_dir(path: str) -> str | None:
    """None if DIR holds both runnable binaries, else what is wrong (for the CLI's error)."""
    d = Path(path)
    if not d.is_dir():
        return f"--fabtests: {path} is not a directory"
    for name in (RMA_BW, PINGPONG):
        exe = d / name
        if not (exe.is_file() and os.access(exe, os.X_OK)):
            return f"--fabtests: {exe} is missing or not executable"
    return None


# afabric providers that are not libfabric ones, and the libfabric provider whose fabtests
# are their C reference on the same machine: cma (cross-memory attach within a host) is
# compared with libfabric's same-host provider, shm.
REFERENCE = {"cma": "shm"}


def reference_fabric(provider: str, fabric: str) -> str:
    """The libfabric provider fi_rma_bw/fi_rdm_pingpong run on beside afabric's `provider`."""
    return REFERENCE.get(provider, fabric)


# fi_rma_bw's warm-up operations before its clock starts (fabtests' INIT_OPTS): the rows
# compared with it run as many untimed first.
RMA_WARMUP = 10


def rma_iters(size: int, quick: bool) -> int:
    """fi_rma_bw iterations for one size (as the fabtests pair.sh picks them)."""
    n = 500 if size >= 16 << 20 else 4000 if size >= 1 << 20 else 20000
    return max(100, n // 4) if quick else n


def _endpoints(fabric: str, tag: str) -> tuple[list[str], list[str]]:
    # A port of its own for every pair: fabtests' default (9228) would let two pairs meet.
    port = str(20000 + random.randrange(20000))
    if fabric == "shm":  # shm endpoints are named (name:port), and need distinct names
        return ["-s", f"srv{tag}", "-B", port], ["-s", f"cli{tag}", "-P", port, f"srv{tag}"]
    return ["-s", "127.0.0.1", "-B", port], ["-P", port, "127.0.0.1"]


def _shm_files(tag: str) -> list[Path]:
    shm = Path("/dev/shm")
    return [p for p in shm.iterdir() if tag in p.name] if shm.is_dir() else []


def _wait_server(fabric: str, tag: str, server: subprocess.Popen[bytes]) -> None:
    """Gives the server time to open its endpoint: a shm client that looks first waits forever."""
    deadline = time.monotonic() + 10.0
    while fabric == "shm" and not _shm_files(tag) and server.poll() is None:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    time.sleep(0.7)  # the endpoint exists; let the server reach its receive (as pair.sh does)


def _pair(directory: str, binary: str, fabric: str, opts: list[str]) -> list[str]:
    """Runs server then client; returns the client's last result line, split.

    On the 2-core development machine about one shm pair in ten of fabtests 1.17 never
    finishes (both processes spin; pair.sh's too): such a pair is killed and run again."""
    for attempt in range(_ATTEMPTS):
        try:
            return _pair_once(directory, binary, fabric, opts)
        except _Hung:
            if attempt + 1 == _ATTEMPTS:
                raise
    raise AssertionError("unreachable")


def _pair_once(directory: str, binary: str, fabric: str, opts: list[str]) -> list[str]:
    exe = str(Path(directory) / binary)
    tag = f"{os.getpid()}x{random.randrange(1 << 30)}"
    srv_ep, cli_ep = _endpoints(fabric, tag)
    base = [exe, "-p", fabric, *opts]
    server = subprocess.Popen(
        base + srv_ep, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    client: subprocess.Popen[str] | None = None
    try:
        _wait_server(fabric, tag, server)
        client = subprocess.Popen(base + cli_ep, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = client.communicate(timeout=_TIMEOUT)
        server.wait(timeout=_TIMEOUT)
    except subprocess.TimeoutExpired as e:
        raise _Hung(f"{binary} -p {fabric}: no result in {_TIMEOUT:.0f} s, {_ATTEMPTS} times") from e
    finally:
        for proc in (server, client):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
        # a killed shm endpoint leaves its regions behind: ours are named by tag or by pid
        pids = tuple(f"{p.pid}:" for p in (server, client) if p is not None)
        for f in _shm_files(tag) + [f for f in _shm_files("") if f.name.startswith(pids)]:
            f.unlink(missing_ok=True)
    rc = client.returncode
    lines = [ln.split() for ln in out.splitlines() if ln[:1].isdigit()]
    if rc != 0 or not lines or len(lines[-1]) < 7:
        tail = (err or out).strip().splitlines()[-3:]
        raise FabtestsError(f"{binary} -p {fabric} failed (exit {rc}): {' | '.join(tail)}")
    return lines[-1]


def rma_bw(
    directory: str, fabric: str, size: int, window: int, iters: int, op: str = "writedata",
    delivery_complete: bool = False,
) -> float:  # fmt: skip
    """GB/s of `fi_rma_bw -o <op>` (writedata, or read) at this size and window (its MB/sec
    column / 1000); with ``delivery_complete`` its -U: each write completes once the target
    has it, the completion afabric's writes ask for."""
    opts = ["-o", op, "-S", str(size), "-I", str(iters), "-W", str(window)]
    fields = _pair(directory, RMA_BW, fabric, opts + (["-U"] if delivery_complete else []))
    return float(fields[4]) / 1e3


def pingpong_us(directory: str, fabric: str, size: int, iters: int) -> float:
    """Half round trip in µs of `fi_rdm_pingpong` (its usec/xfer column)."""
    fields = _pair(directory, PINGPONG, fabric, ["-S", str(size), "-I", str(iters)])
    return float(fields[5])
