"""Resource bounds and process hygiene, between real processes over real providers.

- Loading a provider library keeps the application's signal dispositions (Debian's
  libfabric 1.17 pulls in libinfinipath, whose constructor installs its own SIGABRT, BUS,
  ILL, SEGV and TERM handlers; README, Known limitations).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_child(code: str, cwd: Path, timeout: float = 90.0) -> subprocess.CompletedProcess[str]:
    """`code` in a fresh interpreter (nothing loaded yet: the provider library's first load
    happens there), with the working directory `cwd`."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


SIGTERM_CHILD = """
    import asyncio, os, signal, sys, time
    import numpy as np
    import afabric
    from afabric import registry

    got = []
    signal.signal(signal.SIGTERM, lambda *a: got.append("TERM"))
    PROVIDER, HOW = sys.argv[1:3] if len(sys.argv) > 2 else ("{provider}", "{how}")

    async def main() -> None:
        if HOW == "info":  # what `afabric info` and provider="auto" do: probe every provider
            assert any(a.available for a in registry.probe_all())
            return
        async with afabric.Engine(PROVIDER) as a, afabric.Engine(PROVIDER) as b:
            buf = np.zeros(4096, dtype=np.uint8)
            mr = b.register(buf)
            imm = b.alloc_imm()
            src = a.register(np.full(4096, 7, dtype=np.uint8), remote=False)
            await a.write(src, mr.descriptor, 4096, imm=imm)
            await b.expect_imm(imm, 1)
            await a.send(b.address, b"x")
            assert await b.recv() == b"x"

    asyncio.run(main())
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.01)
    print("handled:", got)
    sys.exit(0 if got else 3)
"""


@pytest.mark.parametrize("how", ["engine", "info"])
def test_sigterm_handler_still_runs(provider: str, how: str, tmp_path: Path) -> None:
    """An application's Python SIGTERM handler runs after engines were opened and used (or
    after every provider was probed, as `afabric info` does), and nothing dropped a *.btr
    file into the working directory."""
    r = run_child(SIGTERM_CHILD.format(provider=provider, how=how), tmp_path)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "handled: ['TERM']" in r.stdout
    assert not list(tmp_path.glob("*.btr")), r.stderr


ABORT_CHILD = """
    import asyncio, os, signal
    import afabric

    async def main() -> None:
        async with afabric.Engine("{provider}") as eng:
            eng.register(bytearray(4096))

    asyncio.run(main())
    for s in (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGTERM):
        assert signal.getsignal(s) in (signal.SIG_DFL, signal.default_int_handler), s
    print("ready", flush=True)
    os.abort()
"""


def test_default_dispositions_kept(provider: str, tmp_path: Path) -> None:
    """A process that never set handlers still dies of its own SIGABRT after using an
    engine (the default disposition: killed by the signal, no handler of the provider's
    writing a backtrace file into the working directory and exiting 1)."""
    r = run_child(ABORT_CHILD.format(provider=provider), tmp_path)
    assert "ready" in r.stdout, r.stderr
    assert r.returncode == -signal.SIGABRT, f"exit {r.returncode}\n{r.stderr}"
    assert not list(tmp_path.glob("*.btr")), [p.name for p in tmp_path.iterdir()]
