"""Soft-RoCE test bed: Debian's stock kernel booted under qemu (TCG), with ``rdma_rxe``.

This machine's kernel has no InfiniBand support, but Debian's kernel package ships the
``rdma_rxe`` module. :func:`run` boots that kernel with a small busybox initramfs
(``init.sh`` next to this file) that loads the RDMA and 9p modules, mounts the host's
``/`` read-only over virtio-9p, the work tree and an exchange folder read-write, adds
``rxe0`` on ``dummy0`` (192.0.2.1, a documentation address) and runs a shell script
inside the host's root; the script's exit status comes back through the exchange folder.

Facts this relies on (measured on the development machine): KVM does not work here (the
host is itself a VM), so the guest runs under TCG, and Python runs 25-50x slower in it;
the guest CPU has no AVX-512 (nothing built with -march=native runs there); two rxe
devices in one guest cannot talk to each other, so both ends of a test use rxe0; GID
index 1 of rxe0 is the IPv4-mapped RoCE v2 entry.

The kernel (``apt-get download`` of the package ``linux-image-amd64`` depends on, then
``dpkg -x``) and the initramfs are cached outside the repository, in
``${XDG_CACHE_HOME:-~/.cache}/afabric/rxe``, keyed by kernel version and by the content
of ``init.sh`` and the module list, so a warm run boots without touching apt. Usage::

    python -m tests.rxe.guest -- ibv_devinfo           # any command, in the work tree
    avail, why = available()                           # the host tools are there?
    res = run("python -m pytest -q tests/rxe/guest_verbs.py", timeout=240)
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gzip
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
INIT = HERE / "init.sh"
REQUIRE_ENV = "AFABRIC_REQUIRE_RXE"

# Modules the guest loads, each with its dependencies first (computed with modprobe).
# crc32_generic: rxe asks the crypto API for "crc32" (ENOENT on `rdma link add` without it).
MODULES = ["crc32_generic", "virtio_pci", "9pnet_virtio", "9p", "dummy", "rdma_rxe", "ib_uverbs"]
MODULE_ARGS = {"dummy": "numdummies=1"}
QEMU = "qemu-system-x86_64"
HOST_TOOLS = [QEMU, "busybox", "modprobe", "depmod", "dpkg", "apt-get", "rdma"]
MEM_MB = 2048


class HarnessError(RuntimeError):
    """The guest could not be built or booted (not a failure of the tests inside it)."""


@dataclass(frozen=True)
class Image:
    kernel: Path
    initrd: Path
    kver: str


@dataclass(frozen=True)
class Result:
    rc: int
    output: str  # what the command printed (stdout and stderr)
    console: str  # the guest's serial console (kernel and harness messages)
    boot_s: float  # guest uptime when the command started
    total_s: float


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "afabric" / "rxe"


def available() -> tuple[bool, str]:
    """Whether the host has what building and booting the guest needs."""
    missing = [t for t in HOST_TOOLS if shutil.which(t) is None]
    if missing:
        return False, f"missing host tools: {', '.join(missing)} (bash tests/run.sh --rxe installs them)"
    if not Path("/usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists():
        return False, "libibverbs1 is not installed (the guest uses the host's /)"
    return True, ""


def require() -> None:
    """In a test: skip when the bed is unavailable, or fail when $AFABRIC_REQUIRE_RXE=1."""
    import pytest

    ok, why = available()
    if ok:
        return
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but the Soft-RoCE guest is unavailable: {why}")
    pytest.skip(f"Soft-RoCE guest unavailable: {why}")


def _sh(cmd: list[str], **kw: object) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise HarnessError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return str(proc.stdout)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _recipe_hash() -> str:
    h = hashlib.sha256(INIT.read_bytes())
    h.update(repr((MODULES, MODULE_ARGS)).encode())
    h.update(Path(shutil.which("busybox") or "busybox").read_bytes())
    return h.hexdigest()[:16]


def _modules_hash() -> str:
    return hashlib.sha256(repr(MODULES).encode()).hexdigest()[:12]


def _kernel_deb(root: Path) -> Path:
    """The kernel package: any cached one, else the one linux-image-amd64 depends on now."""
    debs = sorted((root / "debs").glob("linux-image-*.deb"))
    if debs:
        return debs[-1]
    try:
        deps = _sh(["apt-cache", "depends", "linux-image-amd64"])
    except HarnessError:  # a fresh container without package lists
        _sh(["apt-get", "update", "-qq"])
        deps = _sh(["apt-cache", "depends", "linux-image-amd64"])
    m = re.search(r"Depends:\s*(linux-image-\S+-amd64)", deps)
    if not m:
        raise HarnessError(f"apt-cache depends linux-image-amd64 names no kernel:\n{deps}")
    (root / "debs").mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _sh(["apt-get", "download", "-q", m.group(1)], cwd=tmp)
        got = list(Path(tmp).glob("*.deb"))
        if len(got) != 1:
            raise HarnessError(f"apt-get download {m.group(1)} gave {got}")
        dest = root / "debs" / got[0].name
        os.replace(got[0], dest)
    return dest


def _kernel_dir(root: Path) -> Path:
    """vmlinuz plus the modules the guest loads (in load order), from the kernel package."""
    mh = _modules_hash()
    have = sorted(root.glob(f"kernel-*-{mh}/ok"))
    if have:
        return have[-1].parent
    deb = _kernel_deb(root)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        ext = Path(tmp) / "x"
        _sh(["dpkg", "-x", str(deb), str(ext)])
        kver = next((ext / "lib" / "modules").iterdir()).name
        _sh(["depmod", "-b", str(ext), kver])
        kdir = root / f"kernel-{kver}-{mh}"
        shutil.rmtree(kdir, ignore_errors=True)
        kdir.mkdir(parents=True)
        shutil.copy(ext / "boot" / f"vmlinuz-{kver}", kdir / "vmlinuz")
        order: list[str] = []
        for mod in MODULES:
            out = _sh(["modprobe", "-d", str(ext), "-S", kver, "-C", "/dev/null", "--show-depends", mod])
            for line in out.splitlines():
                parts = line.split()
                if parts[:1] != ["insmod"]:
                    continue  # "builtin ..."
                src = Path(parts[1])
                if src.name not in order:
                    order.append(src.name)
                    shutil.copy(src, kdir / src.name)
        (kdir / "order").write_text("\n".join(order) + "\n")
        (kdir / "kver").write_text(kver + "\n")
        (kdir / "ok").write_text(deb.name + "\n")
    return kdir


def _cpio_newc(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A newc cpio archive of regular files and directories (mode decides which)."""
    out = bytearray()
    ino = 1
    for name, (data, mode) in [*files.items(), ("TRAILER!!!", (b"", 0))]:
        nb = name.encode() + b"\0"
        fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(nb), 0]
        out += b"070701" + b"".join(b"%08X" % f for f in fields) + nb
        out += b"\0" * (-len(out) % 4) + data
        out += b"\0" * (-len(out) % 4)
        ino += 1
    return bytes(out)


def image() -> Image:
    """The cached kernel and initramfs, built on first use (under a lock)."""
    root = cache_root()
    with _locked(root / ".lock"):
        kdir = _kernel_dir(root)
        kver = (kdir / "kver").read_text().strip()
        initrd = root / f"initrd-{kver}-{_recipe_hash()}.cpio.gz"
        if not initrd.exists():
            d, f, x = 0o040755, 0o100644, 0o100755
            files: dict[str, tuple[bytes, int]] = {
                "bin": (b"", d),
                "modules": (b"", d),
                "init": (INIT.read_bytes(), x),
                "bin/busybox": (Path(shutil.which("busybox") or "").read_bytes(), x),
            }
            order = (kdir / "order").read_text().split()
            lines = []
            for name in order:
                files[f"modules/{name}"] = ((kdir / name).read_bytes(), f)
                lines.append(f"{name} {MODULE_ARGS.get(name.split('.')[0], '')}".rstrip())
            files["modules/order"] = (("\n".join(lines) + "\n").encode(), f)
            tmp = initrd.with_suffix(".tmp")
            tmp.write_bytes(gzip.compress(_cpio_newc(files), compresslevel=1))
            os.replace(tmp, initrd)
    return Image(kdir / "vmlinuz", initrd, kver)


# The host's Python (a venv or pyenv one) comes first on PATH: `python` in the script is
# the interpreter running this harness, with afabric and the test dependencies installed.
_WRAPPER = """\
set -u
cd "$AFABRIC_WORK"
export PATH="{pydir}:$PATH" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
{env}
{script}
"""


def _text(p: Path) -> str:
    return p.read_text(errors="replace") if p.exists() else ""


class Running:
    """A guest booted by :func:`start`; :meth:`wait` collects its :class:`Result`."""

    def __init__(self, proc: subprocess.Popen[bytes], tmp: tempfile.TemporaryDirectory[str],
                 keep: Path | None, t0: float) -> None:
        self.proc, self._tmp, self.keep, self.t0 = proc, tmp, keep, t0
        self.xfer = Path(tmp.name) / "xfer"
        self.console_path = Path(tmp.name) / "console.log"
        self._result: Result | HarnessError | None = None

    def unnice(self) -> None:
        """Back to normal priority (best effort: every qemu thread, as root only)."""
        with contextlib.suppress(OSError):
            for tid in os.listdir(f"/proc/{self.proc.pid}/task"):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, int(tid), 0)

    def kill(self) -> None:
        """Stop the guest if it still runs and remove its files (idempotent)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._tmp.cleanup()

    def wait(self, timeout: float) -> Result:
        """The guest's result, waiting at most ``timeout`` s from now; raises HarnessError
        when it did not get as far as running the script, or was still running then (it
        is killed)."""
        if self._result is None:
            try:
                self._result = self._collect(timeout)
            except HarnessError as e:
                self._result = e
            finally:
                self.kill()
        if isinstance(self._result, HarnessError):
            raise self._result
        return self._result

    def _collect(self, timeout: float) -> Result:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            out = _text(self.xfer / "out.log")
            cons = self.console_path.read_text(errors="replace")
            raise HarnessError(
                f"guest still running after {time.monotonic() - self.t0:.0f} s ({timeout:.0f} s waited)\n"
                f"--- console ---\n{cons[-4000:]}\n"
                f"--- output ---\n{out[-8000:]}"
            ) from None
        total = time.monotonic() - self.t0
        console = self.console_path.read_text(errors="replace")
        xfer = self.xfer
        output = _text(xfer / "out.log")
        if self.keep is not None:
            self.keep.mkdir(parents=True, exist_ok=True)
            for p in xfer.iterdir():
                if p.is_file():
                    shutil.copy(p, self.keep / p.name)
        rc_file = xfer / "rc"
        if not rc_file.exists():
            err = _text(xfer / "harness_error")
            raise HarnessError(
                f"guest did not run the command (qemu exit {self.proc.returncode}) {err}\n"
                f"--- console ---\n{console[-6000:]}"
            )
        rc = int(rc_file.read_text().strip() or "255")
        m = re.search(r"rxe-guest: running at (\d+\.\d+)", console)
        boot = float(m.group(1)) if m else float("nan")
        return Result(rc, output, console, boot, total)


def start(
    script: str,
    *,
    env: dict[str, str] | None = None,
    smp: int = 2,
    files: dict[str, bytes] | None = None,
    keep: Path | None = None,
    nice: int = 0,
) -> Running:
    """Boot the guest to run ``script`` (POSIX sh, in the work tree) and return at once.

    ``files`` are put in the exchange folder, which the script sees as /tmp/xfer (and
    anything it writes there is kept in ``keep`` if given). ``nice`` > 0 runs qemu at that
    niceness (a guest started in the background, beside other work: it then takes mostly
    the CPU time the rest leaves idle). The caller must :meth:`Running.wait` or
    :meth:`Running.kill` it.
    """
    ok, why = available()
    if not ok:
        raise HarnessError(why)
    img = image()
    tmp = tempfile.TemporaryDirectory(prefix="afabric-rxe-")
    try:
        xfer = Path(tmp.name) / "xfer"
        xfer.mkdir()
        exports = "\n".join(f"export {k}='{v}'" for k, v in (env or {}).items())
        (xfer / "cmd.sh").write_text(
            _WRAPPER.format(pydir=Path(sys.executable).parent, env=exports, script=script)
        )
        for name, data in (files or {}).items():
            (xfer / name).write_bytes(data)
            (xfer / name).chmod(0o755)
        cmd = [
            *(["nice", "-n", str(nice)] if nice > 0 else []),
            QEMU,
            "-machine", "q35",
            "-accel", "tcg,thread=multi",
            "-cpu", "max",
            "-smp", str(smp),
            "-m", str(MEM_MB),
            "-nographic", "-no-reboot", "-nodefaults",
            "-serial", "stdio",
            "-kernel", str(img.kernel),
            "-initrd", str(img.initrd),
            "-append", f"console=ttyS0 panic=-1 quiet loglevel=4 afabric.work={REPO}",
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            "-virtfs", f"local,path={REPO},mount_tag=work,security_model=none,multidevs=remap",
            "-virtfs", f"local,path={xfer},mount_tag=xfer,security_model=none,multidevs=remap",
        ]  # fmt: skip
        t0 = time.monotonic()
        # the console goes to a file, not a pipe: nobody has to drain it while the guest runs
        with (Path(tmp.name) / "console.log").open("wb") as console:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT)
    except BaseException:
        tmp.cleanup()
        raise
    return Running(proc, tmp, keep, t0)


def run(
    script: str,
    *,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    smp: int = 2,
    files: dict[str, bytes] | None = None,
    keep: Path | None = None,
) -> Result:
    """Boot the guest, run ``script`` (POSIX sh, in the work tree), return its status
    (:func:`start`, then wait at most ``timeout`` s for it)."""
    return start(script, env=env, smp=smp, files=files, keep=keep).wait(timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Run a command in the Soft-RoCE qemu guest.")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--smp", type=int, default=2)
    ap.add_argument("--keep", type=Path, help="copy the exchange folder here afterwards")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="shell command (after --)")
    ns = ap.parse_args(argv)
    words = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    script = " ".join(words) or "ibv_devinfo -v"
    try:
        res = run(script, timeout=ns.timeout, smp=ns.smp, keep=ns.keep)
    except HarnessError as e:
        print(f"rxe guest: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(res.output)
    print(f"[rxe guest: exit {res.rc}, {res.total_s:.1f} s in all]", file=sys.stderr)
    return res.rc


if __name__ == "__main__":
    sys.exit(main())
