"""The documentation keeps its promises: the README stays an index, the configuration page
names every knob the code reads, the API reference covers every public name and is
generated from docstrings that say their parameters, returns and raises, and the site
builds with warnings as errors and shows its content in a real browser.

The site tests need the ``docs`` extra (MkDocs, Material, mkdocstrings) and Debian's
``chromium``; they skip, saying so, where those are missing, unless AFABRIC_REQUIRE_DOCS=1
(tests/run.sh sets it and installs both)."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

import afabric

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
REQUIRED = os.environ.get("AFABRIC_REQUIRE_DOCS") == "1"
# Where the product reads its environment: the package, the shim, the providers, the example
# plugin. A quoted "AFABRIC_..." literal there is a variable name (header guards are bare).
SOURCES = ("afabric", "shim", "providers", "examples")
ENV_LITERAL = re.compile(r"""["'](AFABRIC_[A-Z0-9_]+)["']""")


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """Nothing here opens an engine: a /dev/shm file appearing meanwhile is another run's."""
    yield


def _missing(what: str) -> None:
    if REQUIRED:
        pytest.fail(f"{what} (AFABRIC_REQUIRE_DOCS=1: tests/run.sh installs it)")
    pytest.skip(what)


# ---- the README ----


def test_readme_is_an_index() -> None:
    """At most 200 lines, with the install and test commands CI and tests/fresh_machine.sh
    read, the example, the transports, and links into the docs that resolve."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200, f"README.md has {len(text.splitlines())} lines (at most 200)"
    first_sh = re.search(r"^```sh\n(.*)$", text, re.MULTILINE)
    assert first_sh, "no ```sh block"
    assert first_sh.group(1).endswith("afabric bench p2p"), "the first ```sh line must install and run"
    assert "bash tests/run.sh" in text
    for provider in ("efa", "verbs", "tcp", "shm", "cma", "nvlink"):
        assert f"`{provider}`" in text, f"the transports table lacks {provider}"


def _relative_links(path: Path) -> Iterator[tuple[str, Path]]:
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        yield target, (path.parent / target).resolve()


def test_links_resolve() -> None:
    """Every relative link of the README, the project files and the docs pages names a file
    that exists (mkdocs checks links between pages too; this also covers the README)."""
    pages = [ROOT / n for n in ("README.md", "CONTRIBUTING.md", "SECURITY.md", "CHANGELOG.md")]
    pages += [*sorted(DOCS.rglob("*.md")), ROOT / "tools" / "README.md"]
    broken = [
        f"{page.relative_to(ROOT)}: {target}"
        for page in pages
        for target, dest in _relative_links(page)
        if not dest.exists()
    ]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


# ---- the configuration page ----


def _config_page() -> str:
    return (DOCS / "configuration.md").read_text(encoding="utf-8")


def test_configuration_lists_every_engine_argument() -> None:
    documented = set(re.findall(r"^\| `(\w+)` \|", _config_page(), re.MULTILINE))
    params = [p for p in inspect.signature(afabric.Engine.__init__).parameters if p != "self"]
    missing = [p for p in params if p not in documented]
    assert not missing, f"Engine() arguments missing from docs/configuration.md: {missing}"


def _variables_read() -> dict[str, str]:
    found: dict[str, str] = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix not in (".py", ".c", ".h") or "build" in path.parts:
                continue
            for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
                for name in ENV_LITERAL.findall(line):
                    found.setdefault(name, f"{path.relative_to(ROOT)}:{n}")
    return found


def test_configuration_lists_every_environment_variable() -> None:
    """Every AFABRIC_* variable the code reads is in the table, and every one in the table
    is still read somewhere (a stale row fails as well)."""
    page = _config_page()
    read = _variables_read()
    assert "AFABRIC_PROVIDER" in read and "AFABRIC_CMA_THREADS" in read, "the scan found nothing"
    missing = [f"{name} ({where})" for name, where in sorted(read.items()) if f"`{name}`" not in page]
    assert not missing, "AFABRIC_* variables read but not in docs/configuration.md:\n" + "\n".join(missing)
    env_table = page.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    stale = sorted(set(re.findall(r"^\| `(AFABRIC_[A-Z0-9_]+)`", env_table, re.MULTILINE)) - set(read))
    assert not stale, f"docs/configuration.md lists variables nothing reads: {stale}"


# ---- the API reference ----


def test_api_reference_covers_every_public_name() -> None:
    api = (DOCS / "api" / "index.md").read_text(encoding="utf-8")
    shown = set(re.findall(r"^::: afabric\.(\w+)", api, re.MULTILINE))
    missing = [n for n in afabric.__all__ if n not in shown and n != "errors"]
    assert not missing, f"names of afabric.__all__ missing from docs/api/index.md: {missing}"
    for module in ("errors", "kvcache", "weights", "moe"):
        page = (DOCS / "api" / f"{module}.md").read_text(encoding="utf-8")
        assert f"::: afabric.{module}\n" in page, f"docs/api/{module}.md does not render afabric.{module}"
    assert "<!-- afabric-cli-help -->" in (DOCS / "api" / "cli.md").read_text(encoding="utf-8")


def _documented(func: object) -> list[str]:
    """What a public callable's docstring lacks: Args for its parameters, Returns for a
    value, Raises (every engine operation can fail)."""
    doc = inspect.getdoc(func) or ""
    sig = inspect.signature(func)  # type: ignore[arg-type]
    params = [p for p in sig.parameters if p not in ("self", "cls")]
    lacks = [f"parameter {p}" for p in params if not re.search(rf"^\s+{p}:", doc, re.MULTILINE)]
    if params and "Args:" not in doc:
        lacks.append("Args:")
    returns = sig.return_annotation
    gives = returns not in (None, "None", inspect.Signature.empty) and not inspect.isclass(func)
    if gives and "Returns:" not in doc:
        lacks.append("Returns:")
    return lacks


PUBLIC_CALLABLES = [
    *(f"Engine.{n}" for n in (
        "aclose", "stats", "timings", "register", "register_ptr", "deregister", "allow_peers",
        "write", "write_paged", "write_many", "scatter", "barrier", "read", "read_paged",
        "gather", "peer_group", "uvm_watcher", "alloc_imm", "expect_imm", "send", "recv",
        "recv_bytes", "recv_into",
    )),
    "Engine", "Address.from_bytes", "MrDesc.from_bytes", "UvmWatcher.add", "UvmWatcher.reaches",
    "UvmWatcher.wait_for", "host_buffer", "imm_count",
    "kvcache.Decoder", "kvcache.Decoder.submit", "kvcache.DecodeRequest.wait", "kvcache.Prefiller",
    "weights.WeightTransfer.connect", "weights.WeightTransfer.update", "weights.build_plan",
    "moe.AllToAll", "moe.AllToAll.dispatch", "moe.AllToAll.combine",
]  # fmt: skip


@pytest.mark.parametrize("name", PUBLIC_CALLABLES)
def test_public_docstrings_say_parameters_returns_raises(name: str) -> None:
    head, _, rest = name.partition(".")
    if head in ("kvcache", "weights", "moe"):
        obj: object = importlib.import_module(f"afabric.{head}")
        parts = rest.split(".")
    else:
        obj, parts = afabric, name.split(".")
    for part in parts:
        obj = getattr(obj, part)
    lacks = _documented(obj)
    doc = inspect.getdoc(obj) or ""
    if name.startswith("Engine") and name not in ("Engine.aclose",):
        assert "Raises:" in doc, f"afabric.{name}: no Raises: section"
    assert not lacks, f"afabric.{name}'s docstring lacks {lacks}"


# ---- the site ----


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers"):
        if importlib.util.find_spec(module) is None:
            _missing(f"{module} is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=280, check=False,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}{proc.stderr}"
    return out


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    _missing("no headless Chromium (apt-get install chromium)")
    raise AssertionError("unreachable")


def _render(page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--window-size=1280,1000", *extra, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


def _visible_text(dom: str) -> str:
    body = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.DOTALL)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", body))


@pytest.mark.timeout(400)
def test_site_builds_and_renders_in_a_browser(site: Path, tmp_path: Path) -> None:
    """`mkdocs build --strict`, then headless Chromium loads the home page and the API page:
    the home page shows what afabric is and its navigation, the API page the generated
    reference (signatures, parameters, raises) of the engine and the other public names."""
    home = _render(site / "index.html", "--dump-dom")
    assert home.returncode == 0, home.stderr[-2000:]
    text = _visible_text(home.stdout)
    for expected in ("asyncio-first library for point-to-point RDMA", "Getting started", "API reference",
                     "Known limitations", "Why afabric"):
        assert expected in text, f"the home page does not show {expected!r}"

    api = _render(site / "api" / "index.html", "--dump-dom")
    assert api.returncode == 0, api.stderr[-2000:]
    text = _visible_text(api.stdout)
    for expected in ("afabric.Engine", "write_many", "expect_imm", "Parameters:", "Raises:",
                     "RemoteKeyRejected", "afabric.MrDesc", "afabric.host_buffer", "afabric.UvmWatcher"):
        assert expected in text, f"the API page does not show {expected!r}"
    assert ":meth:" not in text and ":class:" not in text, "Sphinx roles rendered as text"

    cli = _visible_text(_render(site / "api" / "cli" / "index.html", "--dump-dom").stdout)
    assert "usage: afabric bench p2p" in cli, "the CLI page lacks the generated --help"

    shot = tmp_path / "home.png"
    _render(site / "index.html", f"--screenshot={shot}")
    assert shot.exists() and shot.stat().st_size > 10_000, "no screenshot of the home page"


def test_built_api_pages_show_every_public_name(site: Path) -> None:
    """The generated reference holds an entry for every public name: a name whose docstring
    is missing is left out by mkdocstrings, so this fails until it has one."""
    missing = []
    index = (site / "api" / "index.html").read_text(encoding="utf-8")
    missing += [f"afabric.{n}" for n in afabric.__all__ if n != "errors" and f'id="afabric.{n}"' not in index]
    for module in ("kvcache", "weights", "moe"):
        page = (site / "api" / module / "index.html").read_text(encoding="utf-8")
        names = importlib.import_module(f"afabric.{module}").__all__
        missing += [f"afabric.{module}.{n}" for n in names if f'id="afabric.{module}.{n}"' not in page]
    assert not missing, f"public names missing from the generated API reference: {missing}"
