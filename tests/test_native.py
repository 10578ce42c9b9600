"""The native libraries on their own terms: the provider's standalone C test (on Debian's
libfabric and on 2.5.1), sanitizer builds under that test and under part of the Python
suite, a fuzz run of the blob decoders, warning-free builds and exported symbols.

Everything is compiled into temporary directories with build_native.py (the libraries in
the source tree and the installed package are never touched). The sanitizer run of the
Python suite happens in a child process that sets AFABRIC_IN_SANITIZER_RUN=1; this module
skips itself there, so the child never compiles or recurses.
"""

from __future__ import annotations

import importlib.util
import os
import re
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import afabric

from .libfabric2 import require_libfabric2

ROOT = Path(__file__).resolve().parents[1]
NATIVE_TESTS = Path(__file__).resolve().parent / "native"  # the C tests and the fuzzer
GUARD_ENV = "AFABRIC_IN_SANITIZER_RUN"
SANITIZER_MARKERS = (
    "ERROR: AddressSanitizer",
    "ERROR: LeakSanitizer",
    "runtime error:",
    "SUMMARY: UndefinedBehaviorSanitizer",
)
# The part of the Python suite re-run against the ASan/UBSan libraries (~20 s here). Killed
# peers are left out: a SIGKILLed process cannot report, and their shm files need cleanup.
SANITIZER_SUITE = [
    "tests/test_bad_input.py",
    "tests/test_transfer.py",
    "tests/test_groups.py",
    "tests/test_watcher.py",
    "tests/test_multinic.py",
    "tests/test_efa_modes.py",
    "tests/test_shim_safety.py::test_writing_to_a_closed_engine_of_this_process_fails_at_once",
    "tests/test_shim_safety.py::test_a_refused_barrier_is_an_error",
    "tests/test_read.py::test_paged_reads_are_byte_exact",
    "tests/test_read.py::test_gather_from_three_peers_is_byte_exact",
    "tests/test_read.py::test_bad_reads_are_refused_before_posting",
    "tests/test_read.py::test_access_is_checked_before_posting",
    "tests/test_read.py::test_triggered_read_fires_on_an_immediate_and_cancels",
    "tests/test_request.py",
    "tests/test_lengths.py",  # dynamic-length writes: the rma part's dyn_* fields (worker start)
    "-k",
    "not uvloop and not killed",
]
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=0:halt_on_error=1"  # CPython leaks by design
ASAN_OPTIONS_C = "detect_leaks=1:abort_on_error=0:halt_on_error=1"  # the C programs must not
UBSAN_OPTIONS = "halt_on_error=1:print_stacktrace=1"
FUZZ_ITERATIONS = 200_000

pytestmark = pytest.mark.skipif(
    os.environ.get(GUARD_ENV) == "1", reason="inside the sanitizer run of the suite (no recursion)"
)


def _load_build_native() -> ModuleType:
    """build_native.py from the repository root (it is a script, not part of the package)."""
    if "build_native" in sys.modules:
        return sys.modules["build_native"]
    spec = importlib.util.spec_from_file_location("build_native", ROOT / "build_native.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_native"] = mod
    spec.loader.exec_module(mod)
    return mod


bn: Any = _load_build_native()


def sanitizer_reports(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(m in line for m in SANITIZER_MARKERS)]


def run(cmd: list[str], *, env: dict[str, str] | None = None, timeout: float = 60.0,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


def compile_program(cc: list[str], out: Path, sources: list[Path], *, sanitize: bool,
                    defines: tuple[str, ...] = ()) -> Path:
    """A standalone C program with the flags test_ofi.c's header gives (warnings are errors)."""
    opt = [*bn.SANITIZE_FLAGS] if sanitize else ["-O2"]
    cmd = [*cc, "-std=c11", "-D_GNU_SOURCE", *defines, "-g", *opt, "-Wall", "-Wextra", "-Werror",
           f"-I{bn.SHIM_DIR}", *(str(s) for s in sources), "-o", str(out), "-ldl", "-lpthread"]
    proc = run(cmd, timeout=120)
    assert proc.returncode == 0, (
        f"compiling {out.name} failed:\n  {' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    )
    return out


@pytest.fixture(scope="module")
def cc() -> list[str]:
    try:
        return list(bn.compiler())
    except bn.BuildError as e:
        pytest.skip(str(e))


BUILDS = ("release_build", "asan_build", "c_test", "c_test_asan", "fuzz_binary")


@pytest.fixture(scope="module")
def builds(cc: list[str], request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> dict[str, Any]:
    """Every build the module's selected tests need, all at once on first use, two at a time
    (they were serial: ~32 s on 2 cores, ~17 s together): both libraries' release build and
    their ASan+UBSan build (build_native's flags, CFLAGS etc. from the environment removed
    for both, so nothing can weaken -Werror), the provider's C test with each, and the fuzzer."""
    wanted = {name for item in request.session.items if getattr(item, "module", None) is request.module
              for name in getattr(item, "fixturenames", ()) if name in BUILDS}  # fmt: skip
    d = {k: tmp_path_factory.mktemp(k) for k in ("asan", "release", "fuzz", "ctest_asan", "ctest")}
    test_ofi = [NATIVE_TESTS / "test_ofi.c"]
    fuzz_sources = sorted(set(bn.SHIM.sources()) | {NATIVE_TESTS / "fuzz_desc.c"})
    jobs: dict[str, Callable[[], Any]] = {  # the longest first
        "asan_build": lambda: bn.build(d["asan"], d["asan"], sanitize=True),
        "release_build": lambda: bn.build(d["release"], d["release"]),
        "fuzz_binary": lambda: compile_program(cc, d["fuzz"] / "fuzz_desc", fuzz_sources, sanitize=True,
                                               defines=("-DAFABRIC_FUZZ",)),
        "c_test_asan": lambda: compile_program(cc, d["ctest_asan"] / "test_ofi", test_ofi, sanitize=True),
        "c_test": lambda: compile_program(cc, d["ctest"] / "test_ofi", test_ofi, sanitize=False),
    }
    t0 = time.monotonic()
    with pytest.MonkeyPatch.context() as mp, ThreadPoolExecutor(max_workers=2) as pool:
        for var in ("CFLAGS", "CPPFLAGS", "LDFLAGS"):
            mp.delenv(var, raising=False)
        futures = {name: pool.submit(job) for name, job in jobs.items() if name in wanted or not wanted}
        built = {name: f.result() for name, f in futures.items()}
    print(f"builds {sorted(built)}: {time.monotonic() - t0:.1f} s")
    return built


@pytest.fixture(scope="module")
def release_build(builds: dict[str, Any]) -> dict[str, Path]:
    """Both libraries built with build_native's default flags."""
    return dict(builds["release_build"])


@pytest.fixture(scope="module")
def asan_build(builds: dict[str, Any]) -> tuple[dict[str, Path], dict[str, str]]:
    """ASan+UBSan build of both libraries (once per module) and the environment for it."""
    built: dict[str, Path] = builds["asan_build"]
    env: dict[str, str] = bn.sanitizer_env(built["shim"], built["ofi"])
    assert "libasan" in env["LD_PRELOAD"], f"no ASan runtime to preload: {env}"
    return built, env


@pytest.fixture(scope="module")
def c_test(builds: dict[str, Any]) -> Path:
    return Path(builds["c_test"])


@pytest.fixture(scope="module")
def c_test_asan(builds: dict[str, Any]) -> Path:
    return Path(builds["c_test_asan"])


@pytest.fixture(params=["system", "2.5.1"], ids=["libfabric-system", "libfabric-2.5.1"])
def libfabric(request: pytest.FixtureRequest) -> Path | None:
    """None: the system's libfabric.so.1 (Debian: 1.17); else the 2.5.1 library's path."""
    return None if request.param == "system" else require_libfabric2()


def libfabric_env(libfabric: Path | None, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("AFABRIC_LIBFABRIC", None)
    if libfabric is not None:
        env["AFABRIC_LIBFABRIC"] = str(libfabric)
    env.update(extra or {})
    return env


def check_c_test(proc: subprocess.CompletedProcess[str], provider: str, libfabric: Path | None) -> None:
    output = proc.stdout + proc.stderr
    assert not sanitizer_reports(output), f"sanitizer reports:\n{output[-12000:]}"
    assert proc.returncode == 0, f"test_ofi {provider} exited {proc.returncode}:\n{output[-8000:]}"
    assert f"PASS {provider}" in proc.stdout, output[-8000:]
    if libfabric is not None and provider == "tcp":  # AFABRIC_LIBFABRIC was honoured: 2.x tcp is native
        assert "provider=tcp;ofi_rxm" not in proc.stdout, output[-8000:]


# ---- (a) the provider's C test on both libfabrics ---------------------------------------


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_c_test(provider: str, libfabric: Path | None, c_test: Path, release_build: dict[str, Path]) -> None:
    proc = run([str(c_test), provider, str(release_build["ofi"])], env=libfabric_env(libfabric))
    check_c_test(proc, provider, libfabric)


# ---- (b) sanitizers: the C test, then part of the Python suite ---------------------------


@pytest.mark.parametrize("provider", ["tcp", "shm"])
def test_c_test_asan(provider: str, libfabric: Path | None, c_test_asan: Path,
                     asan_build: tuple[dict[str, Path], dict[str, str]]) -> None:
    built, _ = asan_build
    env = libfabric_env(libfabric, {"ASAN_OPTIONS": ASAN_OPTIONS_C, "UBSAN_OPTIONS": UBSAN_OPTIONS})
    check_c_test(run([str(c_test_asan), provider, str(built["ofi"])], env=env), provider, libfabric)


def python_sanitizer_env(asan_env: dict[str, str], log_dir: Path) -> dict[str, str]:
    """The child's environment: sanitizer libraries and runtimes, reports also written to
    log_dir (the suite's own children print into pytest's capture, which a passing test
    discards), and the recursion guard."""
    env = dict(os.environ)
    env.update(asan_env)
    env["ASAN_OPTIONS"] = f"{ASAN_OPTIONS}:log_path={log_dir / 'asan'}"
    env["UBSAN_OPTIONS"] = f"{UBSAN_OPTIONS}:log_path={log_dir / 'ubsan'}"
    env[GUARD_ENV] = "1"
    return env


def logged_reports(log_dir: Path) -> str:
    return "".join(f"--- {p.name}\n{p.read_text(errors='replace')}" for p in sorted(log_dir.iterdir()))


def test_python_sees_the_sanitizer_build(asan_build: tuple[dict[str, Path], dict[str, str]],
                                         tmp_path: Path) -> None:
    """The loader takes AFABRIC_SHIM / AFABRIC_OFI_LIB, and the ASan runtime is in the
    process (the shim falls back to the installed copy when the override fails to load,
    which would make the run below meaningless)."""
    built, asan_env = asan_build
    script = (
        "import afabric_ofi\n"
        "from afabric import _native\n"
        "print(_native.shim().path)\n"
        "print(afabric_ofi.library_path())\n"
        "print(any('libasan' in line for line in open('/proc/self/maps')))\n"
    )
    proc = run([sys.executable, "-c", script], env=python_sanitizer_env(asan_env, tmp_path), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    shim_path, ofi_path, has_asan = proc.stdout.split()
    assert Path(shim_path).resolve() == built["shim"].resolve()
    assert Path(ofi_path).resolve() == built["ofi"].resolve()
    assert has_asan == "True"


@pytest.mark.timeout(300)
def test_python_suite_under_sanitizers(asan_build: tuple[dict[str, Path], dict[str, str]],
                                       tmp_path: Path) -> None:
    _, asan_env = asan_build
    log_dir = tmp_path / "sanitizer-logs"
    log_dir.mkdir()
    env = python_sanitizer_env(asan_env, log_dir)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *SANITIZER_SUITE]
    t0 = time.monotonic()
    try:
        proc = run(cmd, env=env, cwd=ROOT, timeout=270)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"sanitizer run did not finish in 270 s:\n{out[-6000:]}\n{logged_reports(log_dir)}")
    print(f"python suite under ASan/UBSan: {time.monotonic() - t0:.1f} s")
    output = proc.stdout + proc.stderr
    logs = logged_reports(log_dir)
    assert not logs, f"sanitizer reports (log_path):\n{logs[-12000:]}"
    assert not sanitizer_reports(output), f"sanitizer reports:\n{output[-12000:]}"
    assert proc.returncode == 0, f"suite under sanitizers failed (exit {proc.returncode}):\n{output[-8000:]}"
    assert " passed" in proc.stdout, output[-4000:]


# ---- fuzzing the address/descriptor decoders ---------------------------------------------


def encode_address(provider: str, incarnation: int, nic_addrs: list[bytes]) -> bytes:
    """An address blob as shim/codec.c documents it (for seeds the engines cannot make)."""
    name = provider.encode()
    body = b"AFA1" + struct.pack("<BBHQ", len(nic_addrs), len(name), 0, incarnation) + name
    body += b"".join(struct.pack("<H", len(a)) + a for a in nic_addrs)
    return body + struct.pack("<I", zlib.crc32(body))


def encode_descriptor(addr: bytes, base: int, length: int, device: int, keys: list[tuple[int, int]]) -> bytes:
    body = b"AFD1" + struct.pack("<I", len(addr)) + addr
    body += struct.pack("<QQiI", base, length, device, len(keys))
    body += b"".join(struct.pack("<QQ", rbase, key) for rbase, key in keys)
    return body + struct.pack("<I", zlib.crc32(body))


async def fuzz_seeds(directory: Path) -> list[Path]:
    """Real blobs from tcp and shm engines, plus multi-NIC ones encoded here (checked
    against the shim's decoder first)."""
    blobs: dict[str, bytes] = {}
    for provider in ("tcp", "shm"):
        async with afabric.Engine(provider) as eng:
            buf = bytearray(4096)
            mr = eng.register(buf)
            blobs[f"{provider}.desc"] = bytes(mr.descriptor)
            blobs[f"{provider}.addr"] = bytes(eng.address)
            eng.deregister(mr)
    wide = encode_address("p" * 31, 0x0123456789ABCDEF, [bytes([i]) * (1 + 18 * i) for i in range(8)])
    blobs["8nic.desc"] = encode_descriptor(wide, 0x7F00_0000_0000, 1 << 30, 3,
                                           [(0x1000 * i, 0xFEED_0000 + i) for i in range(8)])
    edge = encode_address("efa", 1, [b"\x01" * 32, b"\x02" * 128])
    blobs["edge.desc"] = encode_descriptor(edge, 1 << 63, (1 << 63) - 1, -1, [(0, 1), (2**64 - 1, 2**64 - 1)])
    d = afabric.MrDesc.from_bytes(blobs["8nic.desc"])
    assert (d.nics, d.provider, d.length, d.device) == (8, "p" * 31, 1 << 30, 3)
    d = afabric.MrDesc.from_bytes(blobs["edge.desc"])
    assert (d.nics, d.provider, d.base + d.length, d.device) == (2, "efa", 2**64 - 1, -1)
    assert afabric.Address.from_bytes(wide).nics == 8
    paths = []
    for name, blob in blobs.items():
        p = directory / name
        p.write_bytes(blob)
        paths.append(p)
    return paths


@pytest.fixture(scope="module")
def fuzz_binary(builds: dict[str, Any]) -> Path:
    """tests/native/fuzz_desc.c linked with the shim's sources (not the .so), under ASan+UBSan."""
    return Path(builds["fuzz_binary"])


@pytest.mark.timeout(180)
async def test_fuzz_decoders(fuzz_binary: Path, tmp_path: Path) -> None:
    seeds = await fuzz_seeds(tmp_path)
    env = dict(os.environ, ASAN_OPTIONS=ASAN_OPTIONS_C, UBSAN_OPTIONS=UBSAN_OPTIONS)
    cmd = [str(fuzz_binary), "-n", str(FUZZ_ITERATIONS), "-t", "60", "-s", "20240601", *map(str, seeds)]
    t0 = time.monotonic()
    proc = run(cmd, env=env, timeout=120)
    print(f"fuzz run: {time.monotonic() - t0:.1f} s\n{proc.stdout}")
    output = proc.stdout + proc.stderr
    assert not sanitizer_reports(output), f"sanitizer reports:\n{output[-12000:]}"
    assert proc.returncode == 0, f"fuzz_desc exited {proc.returncode}:\n{output[-8000:]}"
    m = re.search(r"^fuzz_desc: (\d+) iterations", proc.stdout, re.M)
    stats = dict(re.findall(r"(\w+)=(\d+)", proc.stdout))
    assert m and stats, proc.stdout
    iterations = int(m.group(1))
    inputs, past_crc = int(stats["inputs"]), int(stats["past_crc"])
    # bounded by -t 60: a slow machine may stop early, but not before doing real work
    assert iterations >= FUZZ_ITERATIONS // 4, proc.stdout
    # most inputs must get past the checksum (the loop fixes CRCs), some must decode
    assert past_crc > inputs // 3, proc.stdout
    assert int(stats["desc_ok"]) > 0 and int(stats["addr_ok"]) > 0, proc.stdout
    # and the checks behind both checksums (descriptor's and its owner address's) fired
    for reached in ("keys for", "trailing bytes", "bad NIC address length", "bad provider name length",
                    "NICs (#..# allowed)", "region wraps"):
        assert reached in proc.stdout, f"the fuzz run never reached {reached!r}:\n{proc.stdout}"


# ---- (c) warning-free builds and exported symbols ----------------------------------------


def exported(lib: Path) -> set[str]:
    proc = run(["nm", "-D", "--defined-only", str(lib)])
    assert proc.returncode == 0, proc.stderr
    names = set()
    for line in proc.stdout.splitlines():
        parts = line.split()
        # linker-made absolute symbols (_edata, _end, __bss_start on older toolchains)
        if len(parts) == 3 and parts[1] != "A" and parts[2] not in ("_init", "_fini"):
            names.add(parts[2].split("@")[0])
    return names


def header_api() -> set[str]:
    """Every function afabric_shim.h declares with AFS_API: the documented ABI."""
    text = (bn.SHIM_DIR / "afabric_shim.h").read_text()
    return set(re.findall(r"\bAFS_API\b[^;(]*?\b(afs_\w+)\s*\(", text))


def test_builds_are_warning_free_by_default(release_build: dict[str, Path]) -> None:
    """The release build (the fixture) compiled with these flags, so without a warning."""
    assert set(release_build) == {"shim", "ofi", "verbs", "nvlink", "cma"}
    for mode in ({}, {"sanitize": True}, {"debug": True}):
        flags = bn.flags(**mode)
        for flag in ("-Wall", "-Wextra", "-Werror", "-fvisibility=hidden"):
            assert flag in flags, f"build_native.flags({mode}) lacks {flag}: {flags}"


def test_shim_exports_only_its_api(release_build: dict[str, Path]) -> None:
    from afabric import _native

    names = exported(release_build["shim"])
    table = set(_native.FUNCTIONS)
    assert table <= names, f"declared in _native.FUNCTIONS but not exported: {sorted(table - names)}"
    assert all(n.startswith("afs_") for n in names), f"exported without the afs_ prefix: {sorted(names)}"
    undocumented = names - header_api()
    assert not undocumented, f"exported but not declared AFS_API in afabric_shim.h: {sorted(undocumented)}"


def test_provider_exports_only_get_ops(release_build: dict[str, Path]) -> None:
    for provider in ("ofi", "verbs", "nvlink", "cma"):
        assert exported(release_build[provider]) == {"afp_get_ops"}, provider
