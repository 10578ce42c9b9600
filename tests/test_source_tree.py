"""Running from a checkout instead of with the installed package, as a newcomer does:

- from inside a checkout that was never built in place, the source tree's ``afabric`` is
  imported (the current directory comes first on sys.path for ``python -c``, ``-m`` and
  scripts there) and has no compiled shim: the error says so once, with what to do (before:
  "cannot load the afabric shim ... (installed package): not found; reinstall afabric",
  once per provider, six times);
- from the checkout's parent, a directory named ``afabric`` there (the checkout itself)
  would be imported as an empty namespace package ahead of an editable install (before:
  ``module 'afabric' has no attribute 'Engine'``): the editable install's finder comes first.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import afabric

ROOT = Path(__file__).resolve().parent.parent

ENGINE = """
import asyncio
import afabric

async def main() -> None:
    afabric.Engine()

try:
    asyncio.run(main())
except afabric.errors.ShimLoadError as e:
    print(f"ShimLoadError: {e}")
"""


def _checkout_without_shim(tmp_path: Path) -> Path:
    """A checkout's layout (the package beside shim/ and build_native.py), not built."""
    tree = tmp_path / "checkout"
    shutil.copytree(ROOT / "afabric", tree / "afabric",
                    ignore=shutil.ignore_patterns("_lib", "__pycache__", "*.so"))  # fmt: skip
    (tree / "shim").mkdir()
    shutil.copy(ROOT / "shim" / "afabric_shim.h", tree / "shim")
    shutil.copy(ROOT / "build_native.py", tree)
    return tree


@pytest.mark.timeout(120)
def test_unbuilt_source_tree_says_what_is_happening(tmp_path: Path) -> None:
    tree = _checkout_without_shim(tmp_path)
    installed = tmp_path / "site"  # an installed copy further down sys.path
    installed.mkdir()
    (installed / "afabric").symlink_to(ROOT / "afabric", target_is_directory=True)
    # -S: no .pth files, so sys.path is exactly the current directory first, then PYTHONPATH
    # (the installed copy, then this environment's packages for numpy)
    path = f"{installed}:{sysconfig.get_paths()['purelib']}"
    proc = subprocess.run(
        [sys.executable, "-S", "-c", ENGINE], cwd=tree, env={"PYTHONPATH": path},
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and out.startswith("ShimLoadError: "), out
    assert f"afabric is imported from the source tree {tree}, not the installed package in {installed}" in out
    assert "run from another directory" in out and f"pip install -e {tree}" in out, out
    assert out.count("cannot load the afabric shim") == 1, out

    info = subprocess.run(
        [sys.executable, "-S", "-m", "afabric.cli", "info"], cwd=tree, env={"PYTHONPATH": path},
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert info.stdout.count("imported from the source tree") == 1, info.stdout + info.stderr
    assert "auto: nothing usable: the shim is not loaded (above)" in info.stdout, info.stdout


@pytest.mark.timeout(120)
def test_checkout_parent_imports_the_package(tmp_path: Path) -> None:
    (tmp_path / "afabric").symlink_to(ROOT, target_is_directory=True)  # the checkout, by its name
    proc = subprocess.run(
        [sys.executable, "-c", "import afabric; print(afabric.__file__); print(afabric.Engine.__name__)"],
        cwd=tmp_path, capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # the package this test imported itself (the editable install's: this checkout's)
    assert proc.stdout.split() == [str(afabric.__file__), "Engine"], proc.stdout
