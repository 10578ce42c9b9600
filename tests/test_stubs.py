"""The C ABI has one source, the header (shim/afabric_shim.h): afabric/_native_decl.py (the
ctypes constants, structures and FUNCTIONS table) and the stub typings/afabric_shim.pyi that
mypy checks every call against are generated from it by afabric._gen_shim. These tests
fail when the committed files are stale and check what the generator produces against the
C compiler's layout and the loaded library. Error names cross the boundary through the
header's AFS_ERROR_TABLE (read by C and, at run time, by Python) and must all map to Python
classes."""

from __future__ import annotations

import ast
import ctypes
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from afabric import _gen_shim, _native, _native_decl, errors

ROOT = Path(__file__).resolve().parent.parent
STUB = ROOT / "typings" / "afabric_shim.pyi"
HEADER = ROOT / "shim" / "afabric_shim.h"

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


def _header_errors() -> dict[str, tuple[int, str]]:
    """AFS_ERROR_TABLE: name -> (code, text), as the generator reads it."""
    return _gen_shim.parse(HEADER.read_text()).errors


# ---- stub <-> FUNCTIONS ----


def test_stub_types_follow_the_ctypes() -> None:
    """The generator's two renderings agree: integer C types are `int` in the stub, the
    engine handle is EngineHandle, `char *` in-buffers are bytes, pointers name their target
    type, and results match restype."""
    stub = _stub_functions()
    assert set(stub) == set(_native.FUNCTIONS)
    for name, (restype, argtypes) in _native.FUNCTIONS.items():
        fn = stub[name]
        assert "staticmethod" in {d.id for d in fn.decorator_list if isinstance(d, ast.Name)}, name
        params = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
        assert len(params) == _arity(fn) == len(argtypes), name
        for param, argtype in zip(params, argtypes, strict=True):
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
    structs = (n.Config, n.EngineFacts, n.DescInfo, n.Completion, n.NicStats, n.OpTimingStruct)
    structs += (n.Trigger, n.Request)
    for cls in (*structs, n.NicInfoStruct):
        fields = [f[0] for f in cls._fields_]
        annotated = [k for k in cls.__annotations__ if not k.startswith("_")]
        assert annotated == fields, cls.__name__


# ---- header -> generated files ----


def test_generated_files_are_up_to_date() -> None:
    """_native_decl.py and the stub are exactly what the header gives (`python -m
    afabric._gen_shim` rewrites them): an ABI change is made in the header only."""
    stale = [
        str(path.relative_to(ROOT))
        for path, text in _gen_shim.generate(HEADER.read_text()).items()
        if not path.is_file() or path.read_text() != text
    ]
    assert not stale, f"stale, run `python -m afabric._gen_shim`: {stale}"
    assert _gen_shim.main(["--check"]) == 0


def test_native_reexports_the_declarations() -> None:
    """_native declares nothing the header does: its names are the generated objects."""
    for name in dir(_native_decl):
        if not name.startswith("_") and name not in ("TYPE_CHECKING", "annotations", "ctypes"):
            assert getattr(_native, name) is getattr(_native_decl, name), name


def test_header_constants_reach_python() -> None:
    hdr = _gen_shim.parse(HEADER.read_text())
    assert _native.ABI_VERSION == int(hdr.constants["ABI_VERSION"].rstrip("u")) == 12
    assert (_native.C_DONE, _native.C_NOTICE, _native.NO_IMM, _native.TRIG_IMM) == (1, 5, -1, 2)
    assert _native.CFG_TIMING == 0x2 and _native.ALLOW_UNKNOWN == 0x2
    assert len(hdr.functions) > 30 and len(hdr.structs) == 11
    # the request is size-prefixed: ABI 4's request is the smallest the shim accepts
    assert ctypes.sizeof(_native.Request) == _native.REQUEST_MIN_SIZE == 184
    assert _native.Request.trigger.offset == 160 and ctypes.sizeof(_native.Trigger) == 24


def _header_with(snippet: str) -> str:
    """The header with `snippet` added at its end (inside the include guard)."""
    head, tail = HEADER.read_text().rsplit("#endif", 1)
    return f"{head}{snippet}\n#endif{tail}"


@pytest.mark.parametrize(
    "snippet",
    [
        "typedef struct afs_x { float f; } afs_x;",  # not a fixed-width integer
        "typedef struct afs_x { uint32_t a; } afs_x;\nAFS_API int32_t afs_f(afs_x x);",  # by value
        '#define AFS_NAME "tcp"',  # not an integer constant
        "#define OTHER 1",  # not AFS_
        "#pragma once",  # directive outside the subset
        "AFS_API int32_t afs_f(int n);",  # not fixed-width
        "AFS_API double afs_f(void);",
        "static inline int32_t afs_f(void) { return 0; }",
        "AFS_API int32_t afs_f(uint32_t **p);",
        "typedef struct afs_x { afs_y y; } afs_x;",  # a structure not defined (above)
    ],
)
def test_generator_rejects_what_it_does_not_understand(snippet: str) -> None:
    """Outside the subset the generator fails loudly instead of guessing a layout."""
    with pytest.raises(_gen_shim.HeaderError):
        _gen_shim.parse(_header_with(snippet))


def test_generator_reads_the_subset() -> None:
    """The control for the test above: the same shapes, written within the subset, parse."""
    extra = "typedef struct afs_x { uint32_t a; char b[AFS_NO_IMM_LEN]; } afs_x;\n"
    extra += "AFS_API int32_t afs_f(const afs_x *x, const int64_t *idx, afs_engine **e);"
    hdr = _gen_shim.parse(_header_with(f"#define AFS_NO_IMM_LEN 8u\n{extra}"))
    assert hdr.constants["NO_IMM_LEN"] == "8"
    assert [(n, t.ctypes) for n, t in hdr.structs["afs_x"].fields] == [
        ("a", "ctypes.c_uint32"),
        ("b", "ctypes.c_char * 8"),
    ]
    nested = _gen_shim.parse(_header_with("typedef struct afs_y { afs_trigger t; uint8_t b; } afs_y;"))
    assert [(n, t.ctypes, t.field) for n, t in nested.structs["afs_y"].fields] == [
        ("t", "Trigger", "Trigger"),
        ("b", "ctypes.c_uint8", "int"),
    ]
    f = hdr.functions[-1]
    assert f.name == "afs_f" and [t.ctypes for _, t in f.params] == [
        "ctypes.POINTER(X)",
        "ctypes.c_void_p",
        "ctypes.POINTER(EngineHandle)",
    ]


def _c_layout(tmp: Path, include: str, structs: dict[str, list[str]]) -> dict[str, list[int]]:
    """sizeof and each field's offsetof, as the C compiler lays the structures out."""
    cmd = shlex.split(os.environ.get("CC", "")) or ["cc"]
    if shutil.which(cmd[0]) is None:
        pytest.skip(f"no C compiler {cmd[0]!r}")
    lines = ["#include <stddef.h>", "#include <stdio.h>", f'#include "{include}"', "int main(void) {"]
    for c_name, fields in structs.items():
        lines.append(f'printf("{c_name} %zu", sizeof({c_name}));')
        lines += [f'printf(" %zu", offsetof({c_name}, {f}));' for f in fields]
        lines.append('printf("\\n");')
    lines.append("return 0; }")
    src = tmp / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp / "layout"
    build = subprocess.run(
        [*cmd, "-std=c11", "-Wall", "-Werror", f"-I{ROOT / 'shim'}", str(src), "-o", str(exe)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True)
    return {line.split()[0]: [int(v) for v in line.split()[1:]] for line in run.stdout.splitlines()}


def test_structures_have_the_c_layout(tmp_path: Path) -> None:
    """Every generated structure (afp_nic_info included) has C's size and field offsets."""
    hdr = _gen_shim.load(HEADER.read_text())
    classes: dict[str, type[ctypes.Structure]] = {
        s.c_name: getattr(_native_decl, s.py_name) for s in hdr.structs.values()
    }
    assert "afp_nic_info" in classes and len(classes) == 12
    fields = {c: [f[0] for f in cls._fields_] for c, cls in classes.items()}
    (tmp_path / "both.h").write_text('#include "afabric_shim.h"\n#include "afabric_provider.h"\n')
    layout = _c_layout(tmp_path, str(tmp_path / "both.h"), fields)
    for c_name, cls in classes.items():
        py = [ctypes.sizeof(cls), *(getattr(cls, f).offset for f in fields[c_name])]
        assert layout[c_name] == py, f"{c_name}: C (size, offsets) {layout[c_name]} != ctypes {py}"


def test_provider_part_is_found_or_refused() -> None:
    """afp_nic_info and the AFP_CAP_*/AFP_MR_* flags come from afabric_provider.h by name:
    a rename there fails the generator instead of leaving a stale mirror."""
    hdr = _gen_shim.load(HEADER.read_text())
    assert (hdr.constants["CAP_DELIVERY_COMPLETE"], hdr.constants["MR_DEVICE"]) == ("0x20", "0x2")
    assert _native.MR_REMOTE == 1 and _native.CAP_TARGET_COPIES == 0x40
    provider = (ROOT / "shim" / "afabric_provider.h").read_text()
    with pytest.raises(_gen_shim.HeaderError, match="afp_nic_info"):
        _gen_shim.load(HEADER.read_text(), provider.replace("} afp_nic_info;", "} afp_nic_info2;"))
    with pytest.raises(_gen_shim.HeaderError, match="AFP_MR_REMOTE"):
        _gen_shim.load(HEADER.read_text(), provider.replace("AFP_MR_REMOTE 0x1u", "AFP_MR_REMOTE (1u << 0)"))


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
