"""Shared fixtures: providers and loops to run over, peer processes, and the house rules
(an unhandled loop exception or a leaked /dev/shm file fails the test)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a test dependency
    uvloop = None

PROVIDERS = ["tcp", "shm"]
# The few most informative provider-matrix tests also run on the first-party cma provider
# (same host, process_vm_writev): @pytest.mark.parametrize("provider", WITH_CMA).
WITH_CMA = [*PROVIDERS, "cma"]
# The fault, peer, access and bad-input suites also run on the default engine, which routes
# (cma to this host's processes, tcp otherwise): those modules override `provider` with it.
WITH_ROUTED = [*PROVIDERS, "auto"]


@functools.cache
def libfabric_version() -> tuple[int, int]:
    """Version of the libfabric the provider library will load (AFABRIC_LIBFABRIC or the
    system's), for tests of behaviour that differs between libfabric releases. Asked in a
    child process: loading Debian's libfabric.so.1 outside the shim (which keeps the
    process's signal dispositions) would let libinfinipath take over SIGSEGV & co. here."""
    code = (
        "import ctypes, os; lib = ctypes.CDLL(os.environ.get('AFABRIC_LIBFABRIC', 'libfabric.so.1'));"
        " lib.fi_version.restype = ctypes.c_uint32; print(lib.fi_version())"
    )
    v = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    return v >> 16, v & 0xFFFF


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Any]:
    """Tests marked `both_loops` run on asyncio's loop and on uvloop; the rest on asyncio."""
    loops: dict[str, Any] = {"asyncio": asyncio.new_event_loop}
    if item.get_closest_marker("both_loops") and uvloop is not None:
        loops["uvloop"] = uvloop.new_event_loop
    return loops


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "both_loops: run on asyncio and on uvloop")
    config.addinivalue_line("markers", "slow: long-running test")


def pytest_collection_finish(session: Any) -> None:
    """Modules with a long, self-contained background job (test_verbs: the Soft-RoCE guest)
    start it now, so that it runs beside the tests collected before them."""
    by_module: dict[Any, list[Any]] = {}
    for item in session.items:
        if hasattr(getattr(item, "module", None), "start_early"):
            by_module.setdefault(item.module, []).append(item)
    for module, items in by_module.items():
        module.start_early(session.config, items)


@pytest.fixture(params=PROVIDERS)
def provider(request: Any) -> str:
    return str(request.param)


def loop_name() -> str:
    """Which loop the running test uses ("asyncio" or "uvloop"), for child processes."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"


@pytest.fixture(autouse=True)
async def _loop_exceptions() -> Any:
    """Fail a test when its loop reports an unhandled exception."""
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: seen.append(ctx))
    yield seen
    assert not seen, f"unhandled exceptions in the event loop: {seen}"


def _ours_or_orphaned(name: str) -> bool:
    """shm files are named '<pid>:...': ours, or of a process that is gone (a peer). Files
    of other live processes (a parallel test run) are not this test's business."""
    pid = name.split(":", 1)[0]
    if not pid.isdigit():
        return True
    return int(pid) == os.getpid() or not Path(f"/proc/{pid}").exists()


def _shm_files() -> set[str]:
    d = Path("/dev/shm")
    return {p.name for p in d.iterdir()} if d.is_dir() else set()


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """A test must leave no /dev/shm file behind (libfabric's shm provider leaves them
    when a process dies uncleanly; tests that kill peers clean up with `shm_cleanup`)."""
    before = _shm_files()
    yield
    leaked = {n for n in _shm_files() - before if _ours_or_orphaned(n)}
    for name in leaked:  # remove them so one failure does not cascade
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")
    assert not leaked, f"/dev/shm files left behind: {sorted(leaked)}"


@pytest.fixture
def shm_cleanup() -> Iterator[None]:
    """For tests that SIGKILL a peer: remove the files the dead process could not (only
    files of processes that are gone: a live one's may belong to a parallel test run)."""
    before = _shm_files()
    yield
    for name in _shm_files() - before:
        pid = name.split(":", 1)[0]
        if pid.isdigit() and Path(f"/proc/{pid}").exists():
            continue
        with contextlib.suppress(OSError):
            os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def peers() -> Iterator[list[Any]]:
    """Peer processes started by a test; all are killed at teardown."""
    started: list[Any] = []
    yield started
    for p in started:
        p.close()
    # a killed peer cannot remove its /dev/shm files (libfabric shm names them '<pid>:...')
    pids = {str(p.proc.pid) for p in started}
    for name in _shm_files():
        if name.split(":", 1)[0] in pids:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{name}")
