"""Nothing is left in /dev/shm however a run ends (shm's endpoint files, 16 MiB each, and
cma's segments, 10 MiB: before, every SIGTERM'd benchmark left 20-32 MiB there for good).

- ``afabric bench p2p`` stopped by SIGINT (Ctrl-C signals the whole process group),
  SIGTERM (``timeout``: the group; ``kill``: the command alone) or SIGHUP: one line on
  stderr, no traceback (before: 33 lines from the child), exit status 128 + the signal's
  number, and no file of any of its processes left, at once; failing by an exception in
  its target process: the same, exit status 1 and the child's error in the line;
- its target SIGKILLed: what the dead process left, the next engine on the host reclaims;
- an application of two engines it never closes: at exit (a return, an exception, Ctrl-C)
  atexit closes them, nothing is left at once; killed by a signal nobody handles (SIGTERM,
  SIGHUP: the library installs no handlers) or by SIGKILL, its files are reclaimed by the
  next engine of the provider once the process is gone.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import afabric

BIN = Path(sys.executable).parent
LEAVES_FILES = ["shm", "cma"]  # tcp keeps nothing in /dev/shm


def _shm_of(pids: set[int]) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.split(":", 1)[0] in {str(p) for p in pids})


def _group(pgid: int) -> set[int]:
    """The processes of process group ``pgid`` (from /proc: no pgrep needed)."""
    found = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[2]) == pgid:
                found.add(int(d))
    return found


class Run:
    """``afabric ARGS`` in a process group of its own, its members recorded as they come."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        full_env = {k: v for k, v in os.environ.items() if k != "AFABRIC_PROVIDER"}
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [str(BIN / "afabric"), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True, env=full_env,
        )  # fmt: skip
        self.pids = {self.proc.pid}
        self._done = threading.Event()
        self._watch = threading.Thread(target=self._record, daemon=True)
        self._watch.start()

    def _record(self) -> None:
        while not self._done.wait(0.1):
            self.pids |= _group(self.proc.pid)

    def wait_for_engines(self, n: int, timeout: float = 90.0) -> None:
        """Until ``n`` of its processes have files in /dev/shm (their engines are open)."""
        deadline = time.monotonic() + timeout
        while len({f.split(":", 1)[0] for f in _shm_of(self.pids)}) < n:
            assert self.proc.poll() is None, self.finish()
            assert time.monotonic() < deadline, "its engines did not open"
            time.sleep(0.1)

    def finish(self, timeout: float = 120.0) -> tuple[int, str, str]:
        out, err = self.proc.communicate(timeout=timeout)
        self._done.set()
        self._watch.join()
        return self.proc.returncode, out, err


def _messages(stderr: str) -> list[str]:
    """stderr without the progress lines ("afabric: 3/11 write 1 MiB (4.2 s, ETA 20 s)")."""
    return [ln for ln in stderr.splitlines() if ln.strip() and not re.match(r"afabric: \d+/\d+ ", ln)]


async def _next_engine(provider: str) -> None:
    async with afabric.Engine(provider):
        pass


@pytest.mark.timeout(200)
@pytest.mark.parametrize(
    ("provider", "signum", "whom"),
    [
        ("shm", signal.SIGINT, "group"),
        ("cma", signal.SIGINT, "group"),
        ("shm", signal.SIGTERM, "group"),
        ("cma", signal.SIGTERM, "command"),
        ("shm", signal.SIGHUP, "group"),
    ],
    ids=lambda v: v.name if isinstance(v, signal.Signals) else str(v),
)
def test_benchmark_stopped_by_a_signal_leaves_nothing(provider: str, signum: int, whom: str) -> None:
    run = Run(["bench", "p2p", "--provider", provider, "--repeat", "50"])
    run.wait_for_engines(2)  # the measuring process's and its target's
    if whom == "group":
        os.killpg(run.proc.pid, signum)
    else:
        os.kill(run.proc.pid, signum)
    rc, out, err = run.finish()
    assert rc == 128 + signum, (rc, err)
    assert "Traceback" not in err, err
    name = signal.Signals(signum).name
    assert _messages(err) == [f"afabric: interrupted ({name}): stopped, engines closed"], err
    assert "py GB/s" not in out
    assert _shm_of(run.pids) == [], f"left in /dev/shm by {sorted(run.pids)}"


CHILD_FAILS = '''
import sys
if "--multiprocessing-fork" in sys.argv:
    from multiprocessing import connection

    def recv(self):
        raise RuntimeError("simulated failure in the child")

    connection.Connection.recv = recv  # the target's wait for "stop": it fails instead
'''


@pytest.mark.timeout(200)
@pytest.mark.parametrize("provider", LEAVES_FILES)
def test_benchmark_whose_child_fails_leaves_nothing(tmp_path: Path, provider: str) -> None:
    (tmp_path / "sitecustomize.py").write_text(CHILD_FAILS)
    run = Run(["bench", "p2p", "--provider", provider], env={"PYTHONPATH": str(tmp_path)})
    rc, _, err = run.finish()
    assert rc == 1, err
    line = err.strip().splitlines()[-1]  # (above it, the child's own traceback: a real failure)
    assert line.startswith("afabric: error: the benchmark's target process"), err
    assert "simulated failure" in line, err
    assert _shm_of(run.pids) == [], f"left in /dev/shm by {sorted(run.pids)}"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("provider", LEAVES_FILES)
async def test_killed_target_is_reclaimed_by_the_next_engine(provider: str, shm_cleanup: None) -> None:
    run = Run(["bench", "p2p", "--provider", provider, "--repeat", "50"])
    run.wait_for_engines(2)
    [target] = {int(f.split(":", 1)[0]) for f in _shm_of(run.pids)} - {run.proc.pid}
    os.kill(target, signal.SIGKILL)
    rc, _, err = run.finish()
    assert rc == 1 and "was killed by SIGKILL" in err, err
    left = _shm_of(run.pids)
    assert left and all(f.startswith(f"{target}:") for f in left), left  # the dead one's only
    await _next_engine(provider)
    assert _shm_of(run.pids) == [], "the next engine did not reclaim the dead process's files"


APP = '''
import asyncio, sys
import numpy as np
import afabric


async def main(provider: str, how: str) -> None:
    a, b = afabric.Engine(provider), afabric.Engine(provider)  # never closed: left to exit
    dst = np.zeros(4096, np.uint8)
    mr = b.register(dst)
    await a.write(a.register(np.full(4096, 7, np.uint8)), mr.descriptor, 4096)
    assert (dst == 7).all()
    print("ready", flush=True)
    if how == "exception":
        raise RuntimeError("the application failed")
    if how != "return":
        await asyncio.sleep(600)


asyncio.run(main(sys.argv[1], sys.argv[2]))
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("provider", LEAVES_FILES)
@pytest.mark.parametrize("how", ["return", "exception", "SIGINT", "SIGTERM", "SIGHUP", "SIGKILL"])
async def test_application_engines_leave_nothing(
    tmp_path: Path, provider: str, how: str, shm_cleanup: None
) -> None:
    app = tmp_path / "app.py"
    app.write_text(APP)
    proc = subprocess.Popen(  # noqa: ASYNC220 - a child of its own; the test waits for it
        [sys.executable, str(app), provider, how], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == "ready\n", proc.communicate(timeout=60)
    engines = {f.split(":")[1] for f in _shm_of({proc.pid})}  # shm: its name's nonce; cma: its token
    assert len(engines) == 2, _shm_of({proc.pid})
    if how.startswith("SIG"):
        proc.send_signal(getattr(signal, how))
    _, err = proc.communicate(timeout=60)
    if how in ("return", "exception", "SIGINT"):  # Python exits: atexit closes the engines
        assert _shm_of({proc.pid}) == [], err
        return
    assert _shm_of({proc.pid}), "killed, it could not remove its files"
    await _next_engine(provider)
    assert _shm_of({proc.pid}) == [], "the next engine did not reclaim the dead process's files"
