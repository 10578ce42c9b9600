"""The tree's layering stays as built: no Python import circle inside afabric/, and the
providers see the shim only through the provider ABI header. Pure static checks (the
sources are parsed, nothing is imported or compiled)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "afabric"
PROVIDERS = ROOT / "providers"


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """Replaces conftest's check: nothing here opens a shm endpoint."""
    yield


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _import_graph() -> dict[str, set[str]]:
    """module -> the afabric modules it imports, counting every import statement: at module
    level, under ``if TYPE_CHECKING:`` and inside functions (a lazy import is a dependency
    all the same; it only runs later). ``from pkg import name`` counts as importing
    ``pkg.name`` when that is a module, else ``pkg``; the implicit import of a module's own
    parent packages is not counted."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base_parts = package.split(".")
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                    base = ".".join([*base_parts, *([node.module] if node.module else [])])
                else:
                    base = node.module or ""
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.add(sub if sub in files else base)
        deps = set()
        for target in targets:
            t = target
            while t and t not in files:  # afabric.x.Name -> afabric.x
                t = t.rpartition(".")[0]
            if t and t != mod:
                deps.add(t)
        graph[mod] = deps
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_afabric() -> None:
    """Each module stands above what it uses. Where a lower module needs a few attributes
    of a higher one (a region of its engine, the rank-0 baseline of its session), it
    declares them as a Protocol instead of importing the higher module, even for typing."""
    graph = _import_graph()
    assert "afabric.engine" in graph and "afabric.memory" in graph["afabric.engine"], "graph is wrong"
    circles = _circles(graph)
    lines = [
        " <-> ".join(c) + "\n" + "\n".join(f"    {m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in circles
    ]
    assert not circles, "import circles inside afabric/:\n" + "\n".join(lines)


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def test_providers_include_only_the_provider_abi() -> None:
    """A provider is built like a third-party one: from ``shim/afabric_provider.h`` (its
    return codes included, ``AFP_E*``) and its own headers, never the Python-facing
    ``afabric_shim.h`` or the shim's private headers."""
    sources = sorted(p for p in PROVIDERS.glob("*/*") if p.suffix in (".c", ".h"))
    assert sources
    bad = []
    for src in sources:
        for name in _INCLUDE.findall(src.read_text()):
            if name != "afabric_provider.h" and not (src.parent / name).is_file():
                bad.append(f"{src.relative_to(ROOT)}: #include \"{name}\"")
    assert not bad, "providers include headers outside the provider ABI:\n" + "\n".join(bad)


SHIM = ROOT / "shim"
# A function with external linkage defined in a shim file (static ones are the file's own).
_C_DEF = re.compile(r"^(?!static)[a-z_][\w \*]*?\b(\w+)\s*\([^;{]*\)\s*\{", re.M)
_C_COMMENT = re.compile(r"/\*.*?\*/", re.S)


def _shim_graph() -> dict[str, set[str]]:
    """shim file -> the shim files whose functions it calls."""
    files = sorted(SHIM.glob("*.c"))
    home = {name: f.stem for f in files for name in _C_DEF.findall(f.read_text())}
    graph: dict[str, set[str]] = {}
    for f in files:
        text = _C_COMMENT.sub("", f.read_text())
        graph[f.stem] = {
            h for name, h in home.items() if h != f.stem and re.search(rf"\b{name}\s*\(", text)
        }
    return graph


def _callers(graph: dict[str, set[str]], name: str) -> set[str]:
    return {f for f, calls in graph.items() if name in calls}


def test_shim_files_call_downwards_only() -> None:
    """The shim's files form layers, each calling only those below it: the pieces (errors,
    util, codec, ring, slots, mpsc, immtab, keys, process; allow: reading an allow-list),
    then worker (the worker thread), watcher (the watcher thread), engine (lifetime,
    peers, registration), the entry points (api, dynlen, allow_set) and over them request
    (afs_submit_req, which hands each op to its builder in api or dynlen). What a
    lower file needs of a higher one's state is in internal.h (afs_engine_check_open is
    inline there); a callback goes through a documented hook (afs_done_hook)."""
    graph = _shim_graph()
    assert "worker" in graph["api"] and "worker" in graph["engine"], "graph is wrong"
    circles = _circles(graph)
    lines = [
        " <-> ".join(c) + "\n" + "\n".join(f"    {m} calls {sorted(graph[m] & set(c))}" for m in c)
        for c in circles
    ]
    assert not circles, "shim files calling each other:\n" + "\n".join(lines)
    assert not graph["worker"] & {"engine", "api", "dynlen", "watcher", "allow_set", "request"}
    assert {"api", "dynlen"} <= graph["request"] and not {"api", "dynlen"} & _callers(graph, "request")
