"""Packaging glue that pyproject.toml cannot express.

- ``build_py`` also compiles the native libraries (build_native.py) straight into the
  build tree, so they land in the wheel as package data: afabric/_lib/libafabric_shim.so
  afabric_ofi/libafabric_ofi.so, afabric_verbs/libafabric_verbs.so and
  afabric_nvlink/libafabric_nvlink.so and afabric_cma/libafabric_cma.so.
- The wheel is platform-tagged but Python-version independent (``py3-none-linux_x86_64``):
  the libraries are loaded with ctypes, they are not CPython extensions.
- An editable install (``pip install -e .``) puts setuptools' finder for its packages
  ahead of Python's path-based one (``_FinderFirst``): run from the checkout's parent, a
  directory named ``afabric`` there (the checkout itself) would otherwise be imported as an
  empty namespace package (``module 'afabric' has no attribute 'Engine'``).
- ``afabric_ofi`` (the first-party libfabric provider plugin) lives in providers/ofi/,
  ``afabric_verbs`` (the libibverbs one) in providers/verbs/, ``afabric_nvlink`` (CUDA IPC
  between the GPUs of a node) in providers/nvlink/, ``afabric_cma`` (cross-memory attach
  within a node) in providers/cma/.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py
from setuptools.errors import CompileError

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # older setuptools: the wheel package's
    from wheel.bdist_wheel import bdist_wheel  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent


def _build_native() -> ModuleType:
    # Loaded by path: with build isolation the source tree need not be on sys.path.
    spec = importlib.util.spec_from_file_location("build_native", HERE / "build_native.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["build_native"] = mod
    spec.loader.exec_module(mod)
    return mod


class BuildPyWithNative(build_py):
    """build_py, then compile the shim and the libfabric provider into the build tree."""

    def run(self) -> None:
        super().run()
        bn = _build_native()
        if getattr(self, "editable_mode", False):
            # `pip install -e .`: the packages are used from the source tree.
            shim_dir, ofi_dir = bn.DEFAULT_SHIM_OUT, bn.DEFAULT_OFI_OUT
            verbs_dir = bn.DEFAULT_VERBS_OUT
            nvlink_dir = bn.DEFAULT_NVLINK_OUT
            cma_dir = bn.DEFAULT_CMA_OUT
        else:
            shim_dir = Path(self.build_lib) / "afabric" / "_lib"
            ofi_dir = Path(self.build_lib) / "afabric_ofi"
            verbs_dir = Path(self.build_lib) / "afabric_verbs"
            nvlink_dir = Path(self.build_lib) / "afabric_nvlink"
            cma_dir = Path(self.build_lib) / "afabric_cma"
        try:
            built = bn.build(
                shim_dir, ofi_dir, out_dir_verbs=verbs_dir, out_dir_nvlink=nvlink_dir,
                out_dir_cma=cma_dir, verbose=bool(self.verbose),
            )
        except bn.BuildError as e:
            raise CompileError(f"afabric: native build failed: {e}") from e
        self._native_outputs = [str(p) for p in built.values()]

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs: list[str] = list(super().get_outputs(include_bytecode))
        return outputs + list(getattr(self, "_native_outputs", []))


class PlatformWheel(bdist_wheel):
    """Platform-specific (it carries .so files), any Python 3: py3-none-<platform>."""

    def finalize_options(self) -> None:
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self) -> tuple[str, str, str]:
        _, _, plat = super().get_tag()
        return "py3", "none", plat


class _FinderFirst:
    """setuptools' editable strategy, plus one .pth file that moves the finder it installs
    (``_TopLevelFinder``: a meta path finder appended after Python's PathFinder) to the
    front of sys.meta_path. Without it, a directory on sys.path named like a package but
    without ``__init__.py`` (the checkout, seen from its parent) becomes a namespace package
    that hides the editable one: PathFinder answers before the appended finder is asked."""

    def __init__(self, inner: Any, finder_module: str, dist_name: str) -> None:
        self.inner, self.module, self.dist_name = inner, finder_module, dist_name

    def __enter__(self) -> _FinderFirst:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self.inner.__exit__(*exc)

    def __call__(self, wheel: Any, files: list[str], mapping: Any) -> None:
        self.inner(wheel, files, mapping)
        m = self.module
        line = (
            f"import sys, {m}; {m}.install(); "
            f"sys.meta_path.remove({m}._EditableFinder); sys.meta_path.insert(0, {m}._EditableFinder)\n"
        )
        wheel.writestr(f"__editable__.{self.dist_name}.first.pth", line.encode())


def _editable_wheel() -> type | None:
    """editable_wheel with _FinderFirst around setuptools' finder strategy (None: a
    setuptools without PEP 660 editable wheels; any other strategy is left as it is)."""
    try:
        from setuptools.command import editable_wheel as ew
    except ImportError:
        return None

    class EditableFinderFirst(ew.editable_wheel):  # type: ignore[misc, name-defined]
        def _select_strategy(self, name: str, tag: str, build_lib: Any) -> Any:
            strategy = super()._select_strategy(name, tag, build_lib)
            finder_type = getattr(ew, "_TopLevelFinder", None)
            if finder_type is None or not isinstance(strategy, finder_type):
                return strategy
            try:
                module = strategy.template_vars()[0]
            except Exception:  # noqa: BLE001 - another setuptools' internals: leave them be
                return strategy
            return _FinderFirst(strategy, module, name)

    return EditableFinderFirst


class BinaryDistribution(Distribution):
    """Says it carries native code, so everything installs into platlib."""

    def has_ext_modules(self) -> bool:
        return True


package_data: dict[str, Any] = {
    "": ["py.typed", "*.cu"],
    "afabric": ["_lib/*.so"],
    "afabric_ofi": ["*.so"],
    "afabric_verbs": ["*.so"],
    "afabric_nvlink": ["*.so"],
    "afabric_cma": ["*.so"],
}

_editable_cmd = _editable_wheel()
_editable = {"editable_wheel": _editable_cmd} if _editable_cmd is not None else {}

setup(
    packages=[
        *find_packages(include=["afabric", "afabric.*"]), "afabric_ofi", "afabric_verbs", "afabric_nvlink",
        "afabric_cma",
    ],
    package_dir={
        "afabric_ofi": "providers/ofi/afabric_ofi",
        "afabric_verbs": "providers/verbs/afabric_verbs",
        "afabric_nvlink": "providers/nvlink/afabric_nvlink",
        "afabric_cma": "providers/cma/afabric_cma",
    },
    package_data=package_data,
    zip_safe=False,
    distclass=BinaryDistribution,
    cmdclass={"build_py": BuildPyWithNative, "bdist_wheel": PlatformWheel, **_editable},
)
