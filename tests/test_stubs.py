"""The C ABI is written down in three places that must agree: the header
(shim/afabric_shim.h), the ctypes table (afabric._native.FUNCTIONS) and the stub
(typings/afabric_shim.pyi) that mypy checks every call against. Error names cross the
boundary through the header's AFS_ERROR_TABLE and must all map to Python classes."""

from __future__ import annotations

import ast
import ctypes
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from afabric import _native, errors

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "typings" / "afabric_shim.pyi"
HEADER = ROOT / "shim" / "afabric_shim.h"

# `AFS_API <return type> afs_name(<parameters>);`, possibly over several lines.
_API_RE = re.compile(r"^\s*AFS_API\s+[^;(]*?\b(afs_\w+)\s*\(([^)]*)\)\s*;", re.MULTILINE)
# `X(NAME, value, "text")` inside `#define AFS_ERROR_TABLE(X) ...`.
_ERROR_RE = re.compile(r'\bX\(\s*(\w+)\s*,\s*(-?\d+)\s*,\s*"((?:[^"\\]|\\.)*)"\s*\)')

_INT_TYPES = (ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64)


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """Replaces conftest's check here: nothing in this module opens a shm endpoint, so a
    /dev/shm file appearing meanwhile belongs to a concurrent run, which this test must
    neither be blamed for nor delete."""
    yield


def _stub_functions() -> dict[str, ast.FunctionDef]:
    """Every function the stub declares, by name (they live in the class ShimLib)."""
    tree = ast.parse(STUB.read_text(), filename=str(STUB))
    found: dict[str, ast.FunctionDef] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            assert node.name not in found, f"{node.name} declared twice in {STUB.name}"
            found[node.name] = node
    return found


def _arity(fn: ast.FunctionDef) -> int:
    a = fn.args
    assert a.vararg is None and a.kwarg is None, f"{fn.name}: *args/**kwargs hide the arity"
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)


def _header_text() -> str:
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)  # comments may hold parentheses
    return re.sub(r"//[^\n]*", " ", text)


def _header_functions() -> dict[str, int]:
    """AFS_API function name -> number of C parameters."""
    out: dict[str, int] = {}
    for name, raw in _API_RE.findall(_header_text()):
        params = " ".join(raw.split())
        out[name] = 0 if params in ("", "void") else params.count(",") + 1
    return out


def _header_errors() -> dict[str, tuple[int, str]]:
    """AFS_ERROR_TABLE: name -> (code, text)."""
    m = re.search(r"#define\s+AFS_ERROR_TABLE\(X\)((?:[^\n]*\\\n)*[^\n]*)", HEADER.read_text())
    assert m, "AFS_ERROR_TABLE not found in the header"
    rows = _ERROR_RE.findall(m.group(1))
    assert rows, "AFS_ERROR_TABLE has no X(...) rows the test can read"
    return {name: (int(code), text) for name, code, text in rows}


# ---- stub <-> FUNCTIONS ----


def test_stub_names_match_the_table() -> None:
    stub = _stub_functions()
    assert set(stub) == set(_native.FUNCTIONS), (
        f"only in the stub: {sorted(set(stub) - set(_native.FUNCTIONS))}; "
        f"only in FUNCTIONS: {sorted(set(_native.FUNCTIONS) - set(stub))}"
    )


def test_stub_arity_matches_argtypes() -> None:
    stub = _stub_functions()
    wrong = {
        name: (_arity(stub[name]), len(argtypes))
        for name, (_, argtypes) in _native.FUNCTIONS.items()
        if name in stub and _arity(stub[name]) != len(argtypes)
    }
    assert not wrong, f"stub arity != len(argtypes) (stub, table): {wrong}"


def test_stub_functions_are_static() -> None:
    """CDLL attributes are plain foreign functions: a method taking `self` would be a lie."""
    for name, fn in _stub_functions().items():
        decorators = {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}
        assert "staticmethod" in decorators, f"{name} is not a @staticmethod"


def test_stub_types_follow_the_ctypes() -> None:
    """Integer C types are `int` in the stub, the engine handle is EngineHandle, `char *`
    in-buffers are bytes, pointers name their target type, and results match restype."""
    stub = _stub_functions()
    for name, (restype, argtypes) in _native.FUNCTIONS.items():
        fn = stub.get(name)
        if fn is None:
            continue  # test_stub_names_match_the_table reports it
        params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        for param, argtype in zip(params, argtypes, strict=False):  # arity: its own test
            assert param.annotation is not None, f"{name}({param.arg}): no annotation"
            ann = ast.unparse(param.annotation)
            where = f"{name}({param.arg}: {ann}) for {argtype.__name__}"
            if argtype in _INT_TYPES:
                assert ann == "int", where
            elif argtype is _native.EngineHandle:
                assert ann == "EngineHandle", where
            elif argtype is ctypes.c_char_p:
                assert "bytes" in ann or "c_char" in ann, where
            elif argtype is ctypes.c_void_p:
                assert "_CVoidPLike" in ann, where
            else:  # POINTER(T): the stub says _Ref[T] with the same T (c_int32 is c_int: compare objects)
                m = re.fullmatch(r"_Ref\[(\w+)\]", ann)
                assert m, where
                named = getattr(ctypes, m.group(1), None) or getattr(_native, m.group(1), None)
                assert named is getattr(argtype, "_type_", None), where
        assert fn.returns is not None, f"{name}: no return annotation"
        ret = ast.unparse(fn.returns)
        if restype is None:
            assert ret == "None", f"{name} -> {ret}"
        elif restype is ctypes.c_char_p:
            assert ret == "bytes | None", f"{name} -> {ret}"
        else:
            assert restype in _INT_TYPES and ret == "int", f"{name} -> {ret} for {restype}"


def test_struct_annotations_match_fields() -> None:
    """The field annotations mypy reads list the same fields, in order, as _fields_."""
    n = _native
    for cls in (n.Config, n.EngineFacts, n.DescInfo, n.Completion, n.NicInfoStruct):
        fields = [f[0] for f in cls._fields_]
        annotated = [k for k in cls.__annotations__ if not k.startswith("_")]
        assert annotated == fields, cls.__name__


# ---- header <-> FUNCTIONS ----


def test_header_functions_match_the_table() -> None:
    header = _header_functions()
    assert len(header) > 20, f"the regex found only {sorted(header)} in {HEADER}"
    assert set(header) == set(_native.FUNCTIONS), (
        f"only in the header: {sorted(set(header) - set(_native.FUNCTIONS))}; "
        f"only in FUNCTIONS: {sorted(set(_native.FUNCTIONS) - set(header))}"
    )
    wrong = {
        name: (n, len(_native.FUNCTIONS[name][1]))
        for name, n in header.items()
        if n != len(_native.FUNCTIONS[name][1])
    }
    assert not wrong, f"header parameter count != len(argtypes) (header, table): {wrong}"


def test_loaded_shim_exports_every_function() -> None:
    s = _native.shim()
    assert s.f.afs_abi_version() == _native.ABI_VERSION
    for name in _native.FUNCTIONS:
        assert hasattr(s.lib, name), name


# ---- the error table ----


def test_error_names_match_the_python_mapping() -> None:
    header = _header_errors()
    assert set(header) == set(errors.known_code_names()), (
        f"no Python class for: {sorted(set(header) - errors.known_code_names())}; "
        f"mapped but not in the header: {sorted(errors.known_code_names() - set(header))}"
    )


def test_error_table_read_at_run_time_matches_the_header() -> None:
    header = _header_errors()
    codes = _native.shim().codes
    assert {name for name, _ in codes.values()} == set(errors.known_code_names())
    assert {name: (code, text) for code, (name, text) in codes.items()} == header


@pytest.mark.parametrize("name", sorted(_header_errors()))
def test_every_error_code_gives_its_class(name: str) -> None:
    """from_code never falls back to the bare root class for a name the header defines
    (except OK, which is never raised, and ENOMEM, which has no better class)."""
    code, text = _header_errors()[name]
    err = errors.from_code(name, code, "doing x", text, "tcp")
    assert isinstance(err, errors.AfabricError)
    assert err.code == code and err.code_name == name
    assert str(err) == f"doing x: {text} ({name}) [provider=tcp]"
    if name not in ("OK", "ENOMEM"):
        assert type(err) is not errors.AfabricError, f"{name} maps to the root class"
