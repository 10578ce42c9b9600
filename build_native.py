"""Compile afabric's native libraries with the system C compiler.

Two shared libraries, both loaded with ctypes/dlopen (never CPython extensions, so one
build serves every Python version):

- ``libafabric_shim.so`` from ``shim/*.c``          -> ``afabric/_lib/``
- ``libafabric_ofi.so``  from ``providers/ofi/*.c`` -> ``providers/ofi/afabric_ofi/``
  (the libfabric provider plugin; it needs libfabric's headers at build time only: it
  dlopens libfabric at run time, so nothing here links it).
- ``libafabric_verbs.so`` from ``providers/verbs/*.c`` -> ``providers/verbs/afabric_verbs/``
  (the libibverbs provider plugin; it needs no rdma-core headers: it carries its own
  declarations, providers/verbs/vb_verbs.h, and dlopens libibverbs at run time).
- ``libafabric_nvlink.so`` from ``providers/nvlink/*.c`` -> ``providers/nvlink/afabric_nvlink/``
  (GPU to GPU within a node through CUDA IPC; needs no CUDA to build: it dlopens libcuda).
- ``libafabric_cma.so`` from ``providers/cma/*.c`` -> ``providers/cma/afabric_cma/`` (host
  memory within a node by cross-memory attach, process_vm_writev).

nvlink and cma are both built from ``providers/common/*.c`` too (the node-local segment,
mailbox, liveness and wakeups they share).

Used by ``setup.py`` (``pip install .`` calls :func:`build` from its build_py step) and
directly::

    python build_native.py                      # into the source tree (for running from it)
    python build_native.py --sanitize --out DIR # ASan+UBSan build of both into DIR
    python build_native.py --sanitize --out DIR --print-env   # + the env to use it

The compiler is ``$CC`` (may hold arguments, e.g. "ccache gcc") or ``cc``; ``$CFLAGS``
and ``$LDFLAGS`` are appended. No ``-march=native``: the libraries must run on any
x86-64 machine the wheel is copied to.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
SHIM_DIR = ROOT / "shim"
OFI_DIR = ROOT / "providers" / "ofi"
VERBS_DIR = ROOT / "providers" / "verbs"
NVLINK_DIR = ROOT / "providers" / "nvlink"
CMA_DIR = ROOT / "providers" / "cma"
COMMON_DIR = ROOT / "providers" / "common"

SHIM_NAME = "libafabric_shim.so"
OFI_NAME = "libafabric_ofi.so"
VERBS_NAME = "libafabric_verbs.so"
NVLINK_NAME = "libafabric_nvlink.so"
CMA_NAME = "libafabric_cma.so"
DEFAULT_SHIM_OUT = ROOT / "afabric" / "_lib"
DEFAULT_OFI_OUT = OFI_DIR / "afabric_ofi"
DEFAULT_VERBS_OUT = VERBS_DIR / "afabric_verbs"
DEFAULT_NVLINK_OUT = NVLINK_DIR / "afabric_nvlink"
DEFAULT_CMA_OUT = CMA_DIR / "afabric_cma"

BASE_FLAGS = [
    "-std=c11",
    "-D_GNU_SOURCE",
    "-g",
    "-fPIC",
    "-shared",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Werror",
]
RELEASE_OPT = ["-O2"]
DEBUG_OPT = ["-O0", "-g3"]
SANITIZE_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1"]
LIBS = ["-ldl", "-lpthread"]

LIBFABRIC_HINT = (
    "libfabric's development headers (rdma/fabric.h) are missing: "
    "apt-get install libfabric-dev (Debian/Ubuntu) or libfabric-devel (RHEL/Fedora); "
    "for a vendor libfabric elsewhere (e.g. /opt/amazon/efa) set CFLAGS=-I/opt/amazon/efa/include"
)


class BuildError(RuntimeError):
    """A native library could not be built; the message says why and what to install."""


@dataclass(frozen=True)
class Library:
    """One shared library: its sources and where it goes by default."""

    name: str
    src_dir: Path
    default_out: Path
    needs_libfabric: bool
    shared: tuple[Path, ...] = ()  # directories of sources compiled into it as well

    def sources(self) -> list[Path]:
        # Every .c file here is library code: the standalone C tests and the fuzzer live in
        # tests/native/.
        return sorted(p for d in (self.src_dir, *self.shared) for p in d.glob("*.c"))

    def headers(self) -> list[Path]:
        return sorted(p for d in (self.src_dir, *self.shared) for p in d.glob("*.h"))


SHIM = Library(SHIM_NAME, SHIM_DIR, DEFAULT_SHIM_OUT, needs_libfabric=False)
OFI = Library(OFI_NAME, OFI_DIR, DEFAULT_OFI_OUT, needs_libfabric=True)
# The verbs provider carries its own libibverbs declarations (vb_verbs.h): no -dev package.
VERBS = Library(VERBS_NAME, VERBS_DIR, DEFAULT_VERBS_OUT, needs_libfabric=False)
NVLINK = Library(NVLINK_NAME, NVLINK_DIR, DEFAULT_NVLINK_OUT, needs_libfabric=False, shared=(COMMON_DIR,))
CMA = Library(CMA_NAME, CMA_DIR, DEFAULT_CMA_OUT, needs_libfabric=False, shared=(COMMON_DIR,))


def compiler() -> list[str]:
    """The C compiler command: $CC (split like a shell would) or cc; BuildError if absent."""
    cmd = shlex.split(os.environ.get("CC", "")) or ["cc"]
    if shutil.which(cmd[0]) is None:
        raise BuildError(f"no C compiler: {cmd[0]!r} not found (set CC, or apt-get install gcc)")
    return cmd


def _env_flags(name: str) -> list[str]:
    return shlex.split(os.environ.get(name, ""))


def flags(*, sanitize: bool = False, debug: bool = False) -> list[str]:
    """Compiler flags for a build mode (sanitize wins over debug for the optimization level)."""
    out = list(BASE_FLAGS)
    if sanitize:
        out += SANITIZE_FLAGS
    elif debug:
        out += DEBUG_OPT
    else:
        out += RELEASE_OPT
    return out


def check_libfabric_headers(cc: Sequence[str] | None = None) -> None:
    """Raise BuildError naming the package to install if <rdma/fabric.h> cannot be included."""
    _check_header("rdma/fabric.h", LIBFABRIC_HINT, cc)


def _check_header(header: str, hint: str, cc: Sequence[str] | None) -> None:
    cmd = [
        *(cc or compiler()),
        *_env_flags("CPPFLAGS"),
        *_env_flags("CFLAGS"),
        "-E",
        "-x",
        "c",
        "-o",
        os.devnull,
        "-",
    ]
    proc = subprocess.run(
        cmd, check=False, input=f"#include <{header}>\n", capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise BuildError(f"{hint}\n(compiler said: {proc.stderr.strip()})")


def build_library(
    lib: Library,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    sanitize: bool = False,
    debug: bool = False,
    verbose: bool = False,
) -> Path:
    """Compile one library into out_dir (default: its place in the source tree).

    The result is written under a temporary name and renamed, so a process loading the
    library never sees a half-written file.
    """
    cc = compiler()
    srcs = lib.sources()
    if not srcs:
        raise BuildError(f"no C sources in {lib.src_dir} for {lib.name}")
    if lib.needs_libfabric:
        check_libfabric_headers(cc)
    dest_dir = Path(out_dir) if out_dir is not None else lib.default_out
    dest_dir.mkdir(parents=True, exist_ok=True)
    dest = dest_dir / lib.name
    fd, tmp_name = tempfile.mkstemp(prefix=f".{lib.name}.", suffix=".tmp", dir=dest_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    cmd = [
        *cc,
        *_env_flags("CPPFLAGS"),
        *flags(sanitize=sanitize, debug=debug),
        *_env_flags("CFLAGS"),
        f"-I{SHIM_DIR}",
        *(str(s) for s in srcs),
        "-o",
        str(tmp),
        *_env_flags("LDFLAGS"),
        *LIBS,
    ]
    if verbose:
        print(shlex.join(cmd), file=sys.stderr)
    try:
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(
                f"compiling {lib.name} failed (exit {proc.returncode}):\n  {shlex.join(cmd)}\n"
                f"{proc.stdout}{proc.stderr}".rstrip()
            )
        if verbose and proc.stderr:
            print(proc.stderr, file=sys.stderr, end="")
        tmp.chmod(0o755)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


_GEN_LOCK = threading.Lock()


def check_generated_abi() -> None:
    """_check_generated_abi, one thread at a time: builds run in threads (tests/test_native.py)
    and it lends sys.modules an entry while it runs."""
    with _GEN_LOCK:
        _check_generated_abi()


def _check_generated_abi() -> None:
    """BuildError if afabric/_native_decl.py or typings/afabric_shim.pyi is not what
    shim/afabric_shim.h gives (afabric/_gen_shim.py, stdlib only, loaded by path): the
    Python side of the ABI is never built against a header it was not generated from."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_afabric_gen_shim", ROOT / "afabric" / "_gen_shim.py")
    if spec is None or spec.loader is None:
        raise BuildError("afabric/_gen_shim.py not found")
    gen = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = gen  # dataclasses look their module up while the class is made
    try:
        spec.loader.exec_module(gen)
        stale = [
            str(path.relative_to(ROOT))
            for path, text in gen.generate(gen.HEADER.read_text()).items()
            if path.is_file() and path.read_text() != text  # (a source tree without typings/: no stub)
        ]
    finally:
        del sys.modules[spec.name]
    if stale:
        raise BuildError(
            f"{', '.join(stale)} out of date with shim/afabric_shim.h: run `python -m afabric._gen_shim`"
        )


def build(
    out_dir_shim: str | os.PathLike[str] | None = None,
    out_dir_ofi: str | os.PathLike[str] | None = None,
    *,
    sanitize: bool = False,
    debug: bool = False,
    verbose: bool = False,
    only: Sequence[str] = ("shim", "ofi", "verbs", "nvlink", "cma"),
    out_dir_verbs: str | os.PathLike[str] | None = None,
    out_dir_nvlink: str | os.PathLike[str] | None = None,
    out_dir_cma: str | os.PathLike[str] | None = None,
) -> dict[str, Path]:
    """Build the shim and/or the providers; returns {"shim": path, "ofi": path, "verbs": path}.

    Directories default to the libraries' places in the source tree; the verbs provider
    goes next to the libfabric one when only out_dir_ofi is given (``--out DIR``). Serial
    on purpose (one compiler at a time). Raises BuildError with the compiler's output.
    """
    unknown = set(only) - {"shim", "ofi", "verbs", "nvlink", "cma"}
    if unknown:
        raise BuildError(f"unknown library {sorted(unknown)}; choose from shim, ofi, verbs, nvlink, cma")
    if out_dir_verbs is None:
        out_dir_verbs = out_dir_ofi
    if out_dir_nvlink is None:
        out_dir_nvlink = out_dir_ofi
    if out_dir_cma is None:
        out_dir_cma = out_dir_ofi
    if "shim" in only:
        check_generated_abi()
    out: dict[str, Path] = {}
    for key, lib, dest in (
        ("shim", SHIM, out_dir_shim),
        ("ofi", OFI, out_dir_ofi),
        ("verbs", VERBS, out_dir_verbs),
        ("nvlink", NVLINK, out_dir_nvlink),
        ("cma", CMA, out_dir_cma),
    ):
        if key in only:
            out[key] = build_library(lib, dest, sanitize=sanitize, debug=debug, verbose=verbose)
    return out


def sanitizer_env(
    shim_path: str | os.PathLike[str], ofi_path: str | os.PathLike[str] | None = None
) -> dict[str, str]:
    """Environment for running Python against a sanitizer build.

    Python itself is not built with ASan, so the runtime must be preloaded. Leak detection
    is off: the interpreter's own allocations at exit would drown real reports.
    """
    cc = compiler()
    preload: list[str] = []
    for rt in ("libasan.so", "libubsan.so"):
        proc = subprocess.run([*cc, f"-print-file-name={rt}"], check=False, capture_output=True, text=True)
        path = proc.stdout.strip()
        if proc.returncode == 0 and os.path.isabs(path) and os.path.exists(path):
            preload.append(os.path.realpath(path))
    env = {
        "AFABRIC_SHIM": str(Path(shim_path).resolve()),
        "LD_PRELOAD": " ".join(preload),
        "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    if ofi_path is not None:
        env["AFABRIC_OFI_LIB"] = str(Path(ofi_path).resolve())
    return env


# The variable that points afabric at each library instead of the packaged one.
ENV_VARS = {
    "shim": "AFABRIC_SHIM",
    "ofi": "AFABRIC_OFI_LIB",
    "verbs": "AFABRIC_VERBS_LIB",
    "nvlink": "AFABRIC_NVLINK_LIB",
    "cma": "AFABRIC_CMA_LIB",
}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Build afabric's native libraries (shim, libfabric and verbs providers)."
    )
    ap.add_argument(
        "--out", metavar="DIR", help="put all libraries in DIR (default: their source-tree places)"
    )
    ap.add_argument("--sanitize", action="store_true", help="AddressSanitizer + UBSan build (-O1)")
    ap.add_argument("--debug", action="store_true", help="-O0 -g3")
    ap.add_argument(
        "--only",
        choices=("shim", "ofi", "verbs", "nvlink", "cma"),
        action="append",
        help="build just this library (repeatable; default: both)",
    )
    ap.add_argument(
        "--print-env",
        action="store_true",
        help="print shell exports to use the built libraries (AFABRIC_SHIM, AFABRIC_OFI_LIB,"
        " and LD_PRELOAD for --sanitize)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print the compiler commands")
    ns = ap.parse_args(argv)
    try:
        built = build(
            ns.out,
            ns.out,
            sanitize=ns.sanitize,
            debug=ns.debug,
            verbose=ns.verbose,
            only=tuple(ns.only or ("shim", "ofi", "verbs", "nvlink", "cma")),
        )
        if ns.print_env:
            env = sanitizer_env(built["shim"], built.get("ofi")) if ns.sanitize and "shim" in built else {}
            env.update({ENV_VARS[key]: str(path.resolve()) for key, path in built.items()})
            for k, v in env.items():
                print(f"export {k}={shlex.quote(v)}")
        else:
            for p in built.values():
                print(p)
    except BuildError as e:
        print(f"build_native: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
