"""A long, self-contained command started in the background at low priority, for a test
reached later to collect (tests/test_build.py's fresh Debian machine).

The command runs in its own session at the niceness given, so it takes mostly the CPU time
the tests before its own leave idle; :meth:`Job.wait` first raises every process of the
session back to normal priority. Output goes to files (nobody has to drain a pipe).
:meth:`Job.stop` ends a job never waited for: SIGTERM to the whole session (a script's
cleanup trap still runs), SIGKILL to what is left after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path


def _session_pids(sid: int) -> list[int]:
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            pids.append(int(name))
    return pids


class Job:
    def __init__(self, cmd: Sequence[str], *, env: dict[str, str] | None = None, nice: int = 0) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="afabric-job-"))
        self.t0 = time.monotonic()
        with (self.dir / "stdout").open("wb") as out, (self.dir / "stderr").open("wb") as err:
            self.proc = subprocess.Popen(
                [*(["nice", "-n", str(nice)] if nice > 0 else []), *cmd],
                env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True,
            )  # fmt: skip

    def unnice(self) -> None:
        """Every thread of every process of the session back to niceness 0 (as root only)."""
        for pid in _session_pids(self.proc.pid):
            with contextlib.suppress(OSError):
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with contextlib.suppress(OSError):
                        os.setpriority(os.PRIO_PROCESS, int(tid), 0)

    def wait(self, timeout: float) -> subprocess.CompletedProcess[str]:
        """Its exit status and output, waiting at most timeout s from now (then it is
        stopped and subprocess.TimeoutExpired raised, as subprocess.run does)."""
        self.unnice()
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        out = (self.dir / "stdout").read_text(errors="replace")
        err = (self.dir / "stderr").read_text(errors="replace")
        shutil.rmtree(self.dir, ignore_errors=True)
        return subprocess.CompletedProcess(self.proc.args, rc, out, err)

    def stop(self, grace: float = 60.0) -> None:
        """End the session's processes (SIGTERM, then SIGKILL after grace s) and remove
        the output files; idempotent."""
        if self.proc.poll() is None:
            for pid in _session_pids(self.proc.pid):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace)
        for pid in _session_pids(self.proc.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
