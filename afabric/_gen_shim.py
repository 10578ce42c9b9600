"""Generate the Python side of the shim's ABI from ``shim/afabric_shim.h``, its one source.

``python -m afabric._gen_shim`` parses the header (written to a strict subset of C, see
:func:`parse`) and writes

- ``afabric/_native_decl.py``: the constants, the opaque handle type, the ctypes structures
  (typed annotations for mypy and ``_fields_`` for ctypes, both from one field list) and
  the ``FUNCTIONS`` table (restype, argtypes) that :mod:`afabric._native` applies;
- ``typings/afabric_shim.pyi``: the same functions as typed callables for ``mypy --strict``.

Both are committed with a "generated, do not edit" line; ``--check`` (and
tests/test_stubs.py, and build_native.py) fails when either differs from what the header
gives. A construct outside the subset is an error here, never silently skipped. A
development tool: it reads the headers of a source checkout (a wheel ships the generated
files, not the headers).

The error table is not copied: ``AFS_ERROR_TABLE`` is read by C (the enum and
``afs_error_info``) and by Python at run time through ``afs_error_info``.
"""

from __future__ import annotations

import argparse
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HEADER = ROOT / "shim" / "afabric_shim.h"
PROVIDER_HEADER = ROOT / "shim" / "afabric_provider.h"
DECL = ROOT / "afabric" / "_native_decl.py"
STUB = ROOT / "typings" / "afabric_shim.pyi"
COMMAND = "python -m afabric._gen_shim"

# Fixed-width integers: the only scalar types the subset allows.
_INTS = {
    "uint8_t": "c_uint8",
    "int32_t": "c_int32",
    "uint32_t": "c_uint32",
    "int64_t": "c_int64",
    "uint64_t": "c_uint64",
}
# Python class names that do not follow CamelCase(name without afs_).
_CLASS_NAMES = {"afs_op_timing": "OpTimingStruct"}
_LINE = 110
# What the shim passes through of the provider ABI (afs_provider_probe fills afp_nic_info,
# afs_engine_facts.caps holds AFP_CAP_*, afs_mr_register takes AFP_MR_*): taken from
# afabric_provider.h by name, since that header as a whole is outside the subset.
_PROVIDER_STRUCTS = {"afp_nic_info": "NicInfoStruct"}
_PROVIDER_DEFINES = ("AFP_CAP_", "AFP_MR_")


class HeaderError(ValueError):
    """The header uses a construct outside the subset this generator understands."""


@dataclass(frozen=True)
class CType:
    """A parameter's, field's or result's type as ctypes sees it."""

    ctypes: str  # expression in _native_decl.py ("ctypes.c_uint32", "ctypes.POINTER(Config)")
    stub: str  # annotation in the stub
    field: str  # annotation of a structure field (for mypy)


@dataclass(frozen=True)
class Function:
    name: str
    result: CType | None
    params: list[tuple[str, CType]]
    prototype: str


@dataclass(frozen=True)
class Struct:
    c_name: str
    py_name: str
    fields: list[tuple[str, CType]]


@dataclass
class Header:
    constants: dict[str, str]  # Python name -> literal
    errors: dict[str, tuple[int, str]]  # AFS_ERROR_TABLE: name -> (code, text)
    handles: dict[str, str]  # opaque C typedef -> Python class
    structs: dict[str, Struct]
    functions: list[Function]


def _class_name(c_name: str, suffix: str = "") -> str:
    if c_name in _CLASS_NAMES:
        return _CLASS_NAMES[c_name]
    return "".join(p.capitalize() for p in c_name.removeprefix("afs_").split("_")) + suffix


def _int_literal(text: str) -> str | None:
    """`2u`, `0x1u`, `(-1)` -> Python literal; None for anything else."""
    m = re.fullmatch(r"\(?\s*(-?)\s*(0x[0-9a-fA-F]+|\d+)[uU]?\s*\)?", text.strip())
    return f"{m.group(1)}{m.group(2)}" if m else None


def _strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n") or " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", " ", text)


def _type(decl: str, hdr: Header, *, param: bool, where: str) -> CType:  # noqa: PLR0911, PLR0912
    """Map one C type (without the name) to ctypes; `param` allows pointers to integers etc."""
    t = " ".join(decl.replace("*", " * ").split())
    const = t.startswith("const ")
    base = t.removeprefix("const ").replace(" *", "*")
    stars = base.count("*")
    base = base.rstrip("*")
    if "*" in base or " " in base:
        raise HeaderError(f"{where}: type {decl!r} is outside the subset")
    if stars == 0:
        if base in _INTS:
            return CType(f"ctypes.{_INTS[base]}", "int", "int")
        if not param and base in hdr.structs:  # a structure nested by value (defined above)
            cls = hdr.structs[base].py_name
            return CType(cls, "", cls)
        raise HeaderError(f"{where}: by-value type {decl!r} is outside the subset")
    if base in hdr.handles:
        cls = hdr.handles[base]
        if not param:
            raise HeaderError(f"{where}: handle {base} inside a structure")
        if stars == 1:
            return CType(cls, cls, cls)
        if stars == 2:
            return CType(f"ctypes.POINTER({cls})", f"_Ref[{cls}]", cls)
    if base == "char" and stars == 1:
        # const char *: a string in (or a static string out); char *: a buffer C fills.
        return CType("ctypes.c_char_p", "bytes" if const else "Array[c_char]", "bytes | None")
    if not param or stars != 1:
        if param and base == "char" and stars == 2 and const:
            return CType("ctypes.POINTER(ctypes.c_char_p)", "_Ref[c_char_p]", "")
        raise HeaderError(f"{where}: pointer type {decl!r} is outside the subset")
    if base == "void":
        return CType("ctypes.c_void_p", "_CVoidPLike | None", "")
    if base == "uint8_t" and const:  # a byte string in
        return CType("ctypes.c_char_p", "bytes", "")
    if base in ("int64_t", "uint64_t") and const:  # an array the caller passes by address (numpy)
        return CType("ctypes.c_void_p", "_CVoidPLike | None", "")
    if base in _INTS:
        return CType(f"ctypes.POINTER(ctypes.{_INTS[base]})", f"_Ref[{_INTS[base]}]", "")
    if base in hdr.structs:
        cls = hdr.structs[base].py_name
        return CType(f"ctypes.POINTER({cls})", f"_Ref[{cls}]", "")
    raise HeaderError(f"{where}: unknown type {decl!r}")


def _split_decl(decl: str, where: str) -> tuple[str, str]:
    """`const uint8_t *buf` -> ("const uint8_t *", "buf")."""
    m = re.fullmatch(r"(.*?[\s*])(\w+)", " ".join(decl.split()))
    if not m:
        raise HeaderError(f"{where}: cannot read declaration {decl!r}")
    return m.group(1).strip(), m.group(2)


def _constant(hdr: Header, name: str, literal: str) -> None:
    if name in hdr.constants:
        raise HeaderError(f"constant {name} defined twice")
    hdr.constants[name] = literal


def _preprocess(text: str, hdr: Header) -> str:
    """Handle the directives; return the C declarations that are left."""
    text = text.replace("\\\n", " ")
    out: list[str] = []
    for line in text.split("\n"):
        s = line.strip()
        if not s.startswith("#"):
            out.append(line)
            continue
        m = re.match(r"#\s*define\s+(\w+)(\([^)]*\))?\s*(.*)", s)
        if not m:
            if re.fullmatch(r"#\s*((ifndef|if|else|endif|undef)\b.*|include\s*<stdint\.h>)", s):
                continue
            raise HeaderError(f"directive outside the subset: {s!r}")
        name, args, value = m.group(1), m.group(2), m.group(3).strip()
        if name == "AFS_ERROR_TABLE":
            rows = re.findall(r'\bX\(\s*(\w+)\s*,\s*(-?\d+)\s*,\s*"((?:[^"\\]|\\.)*)"\s*\)', value)
            if not rows or value.count("X(") != len(rows):
                raise HeaderError("AFS_ERROR_TABLE rows must read X(NAME, code, \"text\")")
            hdr.errors = {n: (int(c), t) for n, c, t in rows}
        elif args or name == "AFS_API" or not value:
            continue  # row macros, the export marker, the include guard
        elif name.startswith("AFS_"):
            lit = _int_literal(value)
            if lit is None:
                raise HeaderError(f"#define {name}: only integer constants are allowed, not {value!r}")
            _constant(hdr, name.removeprefix("AFS_"), lit)
        else:
            raise HeaderError(f"#define {name}: names start with AFS_")
    return "\n".join(out)


def _fields(c_name: str, text: str, hdr: Header, sizes: dict[str, str]) -> list[tuple[str, CType]]:
    """The fields of a structure (`sizes`: the constants an array size may name)."""
    fields: list[tuple[str, CType]] = []
    for fdecl in filter(None, (f.strip() for f in text.split(";"))):
        first, *more = (d.strip() for d in fdecl.split(","))
        ftype, _ = _split_decl(re.sub(r"\[\s*\w+\s*\]$", "", first), c_name)
        for name_decl in [first, *more]:
            am = re.fullmatch(r"(?:.*?[\s*])?(\w+)\s*(?:\[\s*(\w+)\s*\])?", name_decl)
            if not am:
                raise HeaderError(f"{c_name}: cannot read field {name_decl!r}")
            fname, size = am.group(1), am.group(2)
            where = f"{c_name}.{fname}"
            if size is not None:
                n = _int_literal(size) or sizes.get(size)
                if ftype != "char" or n is None:
                    raise HeaderError(f"{where}: only char arrays of a constant size")
                fields.append((fname, CType(f"ctypes.c_char * {n}", "", "bytes")))
            else:
                fields.append((fname, _type(ftype, hdr, param=False, where=where)))
    return fields


def parse(text: str) -> Header:  # noqa: PLR0912
    """Parse the header. The subset: `#define AFS_X <integer>`, the `AFS_ERROR_TABLE(X)`
    rows, `typedef struct afs_x afs_x;` (opaque handles), `typedef struct afs_x {...} afs_x;`
    with fixed-width integer, `const char *`, `char name[N]` and by-value structure (one
    defined above) fields, enums of
    `AFS_X = <integer>`, and `AFS_API <type> afs_x(<params>);` whose parameters are
    fixed-width integers, handles and pointers (see _type)."""
    hdr = Header({}, {}, {}, {}, [])
    body = _preprocess(_strip_comments(text), hdr)
    for raw in re.findall(r"[^;{}]*(?:\{[^}]*\})?[^;{}]*;", body):
        decl = " ".join(raw.split()).rstrip(";").strip()
        if not decl:
            continue
        if m := re.fullmatch(r"typedef struct (\w+) (\w+)", decl):
            if m.group(1) != m.group(2):
                raise HeaderError(f"{decl}: the typedef must repeat the struct's name")
            hdr.handles[m.group(1)] = _class_name(m.group(1), "Handle")
        elif m := re.fullmatch(r"typedef struct (\w+) \{(.*)\} (\w+)", decl):
            c_name, fields_text = m.group(1), m.group(2)
            if c_name != m.group(3):
                raise HeaderError(f"{c_name}: the typedef must repeat the struct's name")
            sizes = {f"AFS_{k}": v for k, v in hdr.constants.items()}
            fields = _fields(c_name, fields_text, hdr, sizes)
            hdr.structs[c_name] = Struct(c_name, _class_name(c_name), fields)
        elif m := re.fullmatch(r"enum (\w+) \{(.*)\}", decl):
            items = [i.strip() for i in m.group(2).split(",") if i.strip()]
            if items == ["AFS_ERROR_TABLE(AFS_ENUM_ITEM)"]:
                continue  # the error enum: codes are read at run time through afs_error_info
            for item in items:
                im = re.fullmatch(r"AFS_(\w+) = (.+)", item)
                lit = _int_literal(im.group(2)) if im else None
                if im is None or lit is None:
                    raise HeaderError(f"enum {m.group(1)}: {item!r} is not AFS_X = <integer>")
                _constant(hdr, im.group(1), lit)
        elif m := re.fullmatch(r"AFS_API (.+?)\b(afs_\w+) ?\((.*)\)", decl):
            ret, name, params_text = m.group(1).strip(), m.group(2), m.group(3).strip()
            result = None if ret == "void" else _type(ret, hdr, param=True, where=f"{name} result")
            if result is not None and result.ctypes == "ctypes.c_char_p":
                result = CType(result.ctypes, "bytes | None", "")  # a static string, or NULL
            elif result is not None and result.stub != "int":
                raise HeaderError(f"{name}: returns {ret!r}, outside the subset")
            params: list[tuple[str, CType]] = []
            if params_text != "void":
                for p in params_text.split(","):
                    ptype, pname = _split_decl(p, name)
                    params.append((pname, _type(ptype, hdr, param=True, where=f"{name}({pname})")))
            hdr.functions.append(Function(name, result, params, decl.removeprefix("AFS_API ") + ";"))
        else:
            raise HeaderError(f"declaration outside the subset: {decl!r}")
    if not hdr.functions or not hdr.errors:
        raise HeaderError("no AFS_API functions or no AFS_ERROR_TABLE found")
    return hdr


def parse_provider(text: str, hdr: Header) -> None:
    """Add the provider ABI's part that the shim exposes (_PROVIDER_*) to `hdr`."""
    body = _strip_comments(text).replace("\\\n", " ")
    sizes: dict[str, str] = {}
    for name, value in re.findall(r"^[ \t]*#[ \t]*define[ \t]+(AFP_\w+)[ \t]+([^\n]+)$", body, re.MULTILINE):
        lit = _int_literal(value)
        if lit is not None:
            sizes[name] = lit
        if name.startswith(_PROVIDER_DEFINES):
            if lit is None:
                raise HeaderError(f"#define {name}: only integer constants are allowed, not {value!r}")
            _constant(hdr, name.removeprefix("AFP_"), lit)
    flat = " ".join(body.split())
    for c_name, py_name in _PROVIDER_STRUCTS.items():
        m = re.search(rf"typedef struct {c_name} \{{([^}}]*)\}} {c_name};", flat)
        if not m:
            raise HeaderError(f"typedef struct {c_name} {{...}} {c_name}; not found")
        hdr.structs[c_name] = Struct(c_name, py_name, _fields(c_name, m.group(1), hdr, sizes))


def load(header_text: str, provider_text: str | None = None) -> Header:
    """Both parts: the shim's header and what it passes through of the provider's."""
    hdr = parse(header_text)
    parse_provider(PROVIDER_HEADER.read_text() if provider_text is None else provider_text, hdr)
    return hdr


def _decl_module(hdr: Header) -> str:
    out = [
        '"""The shim\'s ABI for ctypes.',
        "",
        f"Generated by `{COMMAND}` from shim/afabric_shim.h (and afp_nic_info, AFP_CAP_*,",
        "AFP_MR_* of shim/afabric_provider.h): do not edit.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
        "import ctypes",
        "from typing import TYPE_CHECKING",
        "",
        "if TYPE_CHECKING:",
        "    from ctypes import _CDataType",
        "",
    ]
    out += [f"{name} = {value}" for name, value in hdr.constants.items()]
    for c_name, cls in hdr.handles.items():
        out += ["", "", f"class {cls}(ctypes.c_void_p):"]
        out.append(f'    """Opaque `{c_name} *` (its own type so no other pointer can be passed for it)."""')
    for s in hdr.structs.values():
        out += ["", "", f"class {s.py_name}(ctypes.Structure):", f'    """`{s.c_name}`."""', ""]
        out += [f"    {name}: {t.field}" for name, t in s.fields]
        out.append("    _fields_ = [")
        out += [f'        ("{name}", {t.ctypes}),' for name, t in s.fields]
        out.append("    ]")
    out += [
        "",
        "",
        "# name -> (restype, argtypes), applied by afabric._native when it loads the shim.",
        "FUNCTIONS: dict[str, tuple[type[_CDataType] | None, list[type[_CDataType]]]] = {",
    ]
    for f in hdr.functions:
        res = f.result.ctypes if f.result else "None"
        args = [t.ctypes for _, t in f.params]
        line = f'    "{f.name}": ({res}, [{", ".join(args)}]),'
        if len(line) <= _LINE:
            out.append(line)
        else:
            out += [f'    "{f.name}": (', f"        {res},", "        ["]
            out += [f"            {a}," for a in args]
            out += ["        ],", "    ),"]
    out.append("}")
    return "\n".join(out) + "\n"


_STUB_HEAD = '''"""The C shim as Python's ctypes sees it, once afabric._native has applied its table.

Generated by `{command}` from shim/afabric_shim.h: do not edit.

One signature per entry of ``afabric._native_decl.FUNCTIONS`` (same names, same parameters),
with the Python values ctypes accepts for each C parameter and what it returns:

- ``uint32_t`` / ``int32_t`` / ``uint64_t`` / ``int64_t`` -> ``int`` (ctypes truncates
  silently, so afabric checks ranges before calling);
- ``const uint8_t *`` / ``const char *`` in-buffers (argtype ``c_char_p``) -> ``bytes``;
- ``char *`` out-buffers -> a ``ctypes.Array[c_char]`` (``create_string_buffer``): never
  ``bytes``, which C must not write into;
- ``const int64_t *`` / ``const uint64_t *`` arrays (argtype ``c_void_p``) and ``void *`` ->
  an address as ``int``, an array or a ``byref``;
- other ``T *`` (argtype ``POINTER(T)``) -> ``ctypes.byref(t)``, ``t`` itself, a pointer or
  an array of ``T``;
- ``afs_engine *`` -> :class:`afabric._native_decl.EngineHandle` only (its own type, so no
  other pointer can be passed for it: ctypes rejects it at run time, mypy before);
- ``const char *`` results (restype ``c_char_p``) -> ``bytes | None``.

There is no ``afabric_shim`` module at run time: ``afabric._native`` imports
:class:`ShimLib` under ``TYPE_CHECKING`` only and casts its loaded ``ctypes.CDLL`` to it,
so every call into the shim is checked by ``mypy --strict``.
"""
'''


def _natural(name: str) -> list[int | str]:
    """Sort key as ruff's isort orders names: digits by value (c_uint8 before c_uint32)."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def _stub(hdr: Header) -> str:
    types = [t for f in hdr.functions for t in ([f.result] if f.result else []) + [t for _, t in f.params]]
    ann = " ".join(t.stub for t in types)
    ctypes_names = sorted(set(re.findall(r"\b(Array|_CArgObject|_CVoidPLike|_Pointer|c_\w+)\b", ann)))
    ctypes_names = sorted({*ctypes_names, "_CArgObject", "_Pointer", "Array"}, key=_natural)
    ours = sorted(n for n in [*hdr.handles.values(), *(s.py_name for s in hdr.structs.values())] if n in ann)
    out = [_STUB_HEAD.format(command=COMMAND), "from ctypes import ("]
    out += [f"    {n}," for n in ctypes_names]
    out += [")", "from typing import TypeAlias, TypeVar", ""]
    out += ["from afabric._native_decl import (", *(f"    {n}," for n in ours), ")", ""]
    out += ['_T = TypeVar("_T")', ""]
    out += [
        "# What ctypes accepts for a `POINTER(T)` argtype (a `T` itself: ctypes passes its address,",
        "# cheaper than a byref object per call).",
        "_Ref: TypeAlias = _T | _Pointer[_T] | Array[_T] | _CArgObject",
        "",
        "class ShimLib:",
        '    """``ctypes.CDLL("libafabric_shim.so")`` after ``afabric._native_decl.FUNCTIONS`` is applied.',
        "",
        "    Attributes of a ``CDLL`` are foreign functions, not methods: hence ``staticmethod``.",
        '    """',
    ]
    for f in hdr.functions:
        ret = f.result.stub if f.result else "None"
        params = ", ".join(f"{n}: {t.stub}" for n, t in f.params)
        out += ["", "    @staticmethod"]
        line = f"    def {f.name}({params}) -> {ret}:"
        if len(line) <= _LINE:
            out.append(line)
        else:
            out.append(f"    def {f.name}(")
            out += [f"        {n}: {t.stub}," for n, t in f.params]
            out.append(f"    ) -> {ret}:")
        doc = textwrap.wrap(f.prototype, _LINE - 14, subsequent_indent="    ")
        doc[0] = '"""' + doc[0]
        doc[-1] += '"""'
        out += [f"        {d}" for d in doc]
    return "\n".join(out) + "\n"


def generate(header_text: str) -> dict[Path, str]:
    """What the header (and the provider header's part) gives: path -> content."""
    hdr = load(header_text)
    return {DECL: _decl_module(hdr), STUB: _stub(hdr)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="fail if a generated file is not up to date")
    args = ap.parse_args(argv)
    stale = []
    for path, text in generate(HEADER.read_text()).items():
        if path.exists() and path.read_text() == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print(f"out of date with shim/afabric_shim.h: {', '.join(stale)}; run `{COMMAND}`", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
