"""The verbs provider, for real: Soft-RoCE (rdma_rxe) in a qemu guest (tests/rxe/guest.py).

One guest boot runs, inside the guest, the C provider test (tests/native/test_verbs.c,
compiled here; once against the release library, once with the test and the library built
with ASan+UBSan, leak detection on) and the multi-process pytest module
tests/rxe/guest_verbs.py; the tests below assert on what ran there. Skipped when the host
lacks qemu and friends, unless $AFABRIC_REQUIRE_RXE=1 (CI), where a broken harness fails.

The guest takes 1.5-3 minutes of CPU (TCG emulation) and little else, so when these tests
are selected it is started in the background as soon as collection ends (tests/conftest.py
calls :func:`start_early`), at niceness 10: it uses the CPU time the tests before this module
leave idle, and the fixture below, when it is reached, raises it back to normal priority and
collects the result. Started there or here, it runs the same script and is judged the same.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import build_native as bn
from afabric import registry

from .rxe import guest

C_TEST = Path(__file__).resolve().parent / "native" / "test_verbs.c"

GUEST_TESTS = 12  # tests in tests/rxe/guest_verbs.py; all must pass, none may be skipped

_SCRIPT = """\
set +e
/tmp/xfer/test_verbs "{lib}" > /tmp/xfer/c.log 2>&1
echo $? > /tmp/xfer/c.rc
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    /tmp/xfer/test_verbs_asan /tmp/xfer/libafabric_verbs_asan.so > /tmp/xfer/c_asan.log 2>&1
echo $? > /tmp/xfer/c_asan.rc
python -m pytest -p no:cacheprovider -p no:hypothesispytest -q -ra --junitxml=/tmp/xfer/junit.xml \\
    tests/rxe/guest_verbs.py > /tmp/xfer/py.log 2>&1
echo $? > /tmp/xfer/py.rc
"""


@dataclass
class GuestRun:
    result: guest.Result
    files: Path


def _read(p: Path) -> str:
    return p.read_text(errors="replace") if p.exists() else "(missing)"


WAIT_S = 540  # for the guest's result, from when the fixture starts waiting
EARLY_NICE = 10
_early: dict[str, Any] = {}  # what start_early began: "running" and "tmp", or "error"


def _start(tmp: Path, nice: int) -> guest.Running:
    """Build the C test (release and ASan) and the ASan provider here, then boot the guest."""
    import afabric_verbs

    lib = Path(afabric_verbs.library_path())
    if not lib.exists():
        pytest.fail(f"{lib} is not built (python build_native.py)")
    exe, exe_asan = tmp / "test_verbs", tmp / "test_verbs_asan"
    for out, opt in ((exe, ["-O2"]), (exe_asan, bn.SANITIZE_FLAGS)):
        cmd = [*bn.compiler(), "-std=c11", "-D_GNU_SOURCE", "-g", *opt, "-Wall", "-Wextra", "-Werror",
               f"-I{bn.SHIM_DIR}", str(C_TEST), "-o", str(out), "-ldl"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        assert proc.returncode == 0, f"compiling test_verbs.c failed:\n{proc.stderr}"
    lib_asan = bn.build_library(bn.VERBS, tmp / "asan", sanitize=True)
    files = {
        "test_verbs": exe.read_bytes(),
        "test_verbs_asan": exe_asan.read_bytes(),
        "libafabric_verbs_asan.so": lib_asan.read_bytes(),
    }
    return guest.start(_SCRIPT.format(lib=lib), files=files, keep=tmp / "xfer", nice=nice)


def start_early(config: pytest.Config, items: list[pytest.Item]) -> None:
    """From tests/conftest.py once collection is done: boot the guest in the background
    if a selected test needs it (not for --collect-only, nor where the guest is missing:
    the fixture then skips or fails as it always did)."""
    if config.option.collectonly or not any("guest_run" in getattr(i, "fixturenames", ()) for i in items):
        return
    if not guest.available()[0]:
        return
    tmp = Path(tempfile.mkdtemp(prefix="afabric-rxe-early-"))
    config.add_cleanup(lambda: shutil.rmtree(tmp, ignore_errors=True))
    try:
        running = _start(tmp, nice=EARLY_NICE)
    except (Exception, pytest.fail.Exception) as e:  # noqa: BLE001 - raised again by the fixture
        _early["error"] = e
        return
    config.add_cleanup(running.kill)  # cleanups run last-in first-out: before the rmtree
    _early.update(running=running, tmp=tmp)


@pytest.fixture(scope="module")
def guest_run(tmp_path_factory: pytest.TempPathFactory) -> GuestRun:
    guest.require()
    if "error" in _early:
        raise _early.pop("error")
    running: guest.Running | None = _early.pop("running", None)
    t0 = time.monotonic()
    if running is None:
        tmp = tmp_path_factory.mktemp("rxe")
        try:
            running = _start(tmp, nice=0)
        except guest.HarnessError as e:
            pytest.fail(f"Soft-RoCE guest failed: {e}")
    else:
        tmp = _early.pop("tmp")
        running.unnice()
    try:
        res = running.wait(WAIT_S)
    except guest.HarnessError as e:
        pytest.fail(f"Soft-RoCE guest failed: {e}")
    print(f"guest: booted in {res.boot_s:.1f} s (guest clock), {res.total_s:.1f} s in all, "
          f"{time.monotonic() - t0:.1f} s waited for here")  # fmt: skip
    assert res.rc == 0, f"guest script exited {res.rc}:\n{res.output[-4000:]}"
    return GuestRun(res, tmp / "xfer")


@pytest.mark.timeout(600)
def test_c_provider_test_passes_in_guest(guest_run: GuestRun) -> None:
    log = _read(guest_run.files / "c.log")
    print(log)
    assert _read(guest_run.files / "c.rc").strip() == "0", f"test_verbs failed:\n{log}"
    # rxe0's GID table: index 0 is the link-local RoCE v2 entry, 1 the IPv4-mapped one
    expected = (
        "provider verbs;rxe0:1 gid 1,",
        "connect + 64 x 16 KiB writes",
        "100000 immediates",
        "RNR NAKs during the burst: sent 0, received 0",
        "never-answering peer: rc -9",
        "target's write after the key error: posted",
        "reconnected after the key error",
        "simultaneous connect: both writes landed",
        "test_verbs: OK",
    )
    for line in expected:
        assert line in log, f"{line!r} missing from the C test's output:\n{log}"


@pytest.mark.timeout(600)
def test_c_provider_test_is_clean_under_asan_in_guest(guest_run: GuestRun) -> None:
    log = _read(guest_run.files / "c_asan.log")
    assert _read(guest_run.files / "c_asan.rc").strip() == "0", f"test_verbs (ASan) failed:\n{log}"
    assert "test_verbs: OK" in log and "ERROR: AddressSanitizer" not in log, log


@pytest.mark.timeout(600)
def test_multiprocess_tests_pass_in_guest(guest_run: GuestRun) -> None:
    log = _read(guest_run.files / "py.log")
    junit = guest_run.files / "junit.xml"
    assert junit.exists(), f"pytest in the guest wrote no report:\n{log}"
    suite = ET.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    print(log[-3000:])
    assert counts == {"tests": GUEST_TESTS, "failures": 0, "errors": 0, "skipped": 0}, (
        f"guest pytest: {counts}\n{log[-6000:]}"
    )


def test_unavailable_without_a_device_says_why() -> None:
    """On a host without RDMA devices the provider loads, finds no NIC, and says so."""
    ib = Path("/sys/class/infiniband")
    if ib.is_dir() and any(ib.iterdir()):
        pytest.skip("this host has RDMA devices")
    a = registry.probe("verbs")
    assert not a.available
    assert "verbs" in a.reason and "ibv_devinfo" in a.reason, a.reason
