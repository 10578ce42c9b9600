"""Provider discovery and choice (afabric.registry) and `afabric info`: pure logic, no
transfer. Broken plugins are real entry points of fake distributions (metadata only),
pointing at a real module written into a temporary directory."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest

import afabric
from afabric import cli, registry
from afabric.errors import AfabricError, PluginError, ProviderUnavailable
from afabric.provider import PROVIDER_ABI_MAJOR, ProviderSpec

FIRST_PARTY = {"efa", "tcp", "shm"}  # the libfabric plugin (afabric_ofi)
OTHER_FIRST_PARTY = {"verbs", "nvlink", "cma"}  # afabric_verbs, afabric_nvlink, afabric_cma
PLUGIN_MODULE = "afabric_test_broken_plugins"


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """Replaces conftest's check here: nothing in this module opens a shm endpoint, so a
    /dev/shm file appearing meanwhile belongs to a concurrent run, which this test must
    neither be blamed for nor delete."""
    yield


def _sockets_installed() -> bool:
    try:
        metadata.distribution("afabric-sockets")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test discovers from scratch, without a provider forced by the environment."""
    monkeypatch.delenv(registry.ENV_PROVIDER, raising=False)
    registry.clear_cache()
    yield
    registry.clear_cache()


class FakeDist(metadata.Distribution):
    """A distribution that exists only as metadata: a name, a version, entry points."""

    def __init__(self, name: str, providers: dict[str, str]) -> None:
        self._name = name
        self._providers = providers

    def read_text(self, filename: str) -> str | None:
        if filename == "METADATA":
            return f"Metadata-Version: 2.1\nName: {self._name}\nVersion: 9.9.9\n"
        if filename == "entry_points.txt":
            lines = "".join(f"{k} = {v}\n" for k, v in self._providers.items())
            return f"[{registry.GROUP}]\n{lines}"
        return None

    def locate_file(self, path: str | os.PathLike[str]) -> Path:
        return Path("/nonexistent") / path


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A real, importable module holding the broken plugins' spec functions."""
    ok = f"library=afabric_ofi.library_path(), fabric_provider='tcp', abi_major={PROVIDER_ABI_MAJOR}"
    (tmp_path / f"{PLUGIN_MODULE}.py").write_text(
        textwrap.dedent(f"""\
            import afabric_ofi
            from afabric.provider import ProviderSpec

            NOT_CALLABLE = 42

            def not_a_spec():
                return {{"name": "notspec"}}

            def wrong_abi():
                return ProviderSpec(name="wrongabi", library=afabric_ofi.library_path(),
                                    fabric_provider="tcp", abi_major={PROVIDER_ABI_MAJOR + 1})

            def no_library():
                return ProviderSpec(name="nolib", library="/nonexistent/libafabric_nothing.so",
                                    fabric_provider="tcp", abi_major={PROVIDER_ABI_MAJOR})

            def raises():
                raise RuntimeError("the plugin's own bug")

            def misnamed():
                return ProviderSpec(name="something_else", {ok})

            def fine():
                return ProviderSpec(name="fine", {ok}, priority=0)
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(PLUGIN_MODULE, None)
    yield PLUGIN_MODULE
    sys.modules.pop(PLUGIN_MODULE, None)  # imported from a directory about to be deleted


# name -> (distribution, entry point value, what the error must say)
BROKEN = {
    "ghost": ("afabric-ghost", "afabric_no_such_module_xyz:spec", "cannot import it"),
    "notspec": ("afabric-notspec", f"{PLUGIN_MODULE}:not_a_spec", "not afabric.provider.ProviderSpec"),
    "notcallable": ("afabric-notcallable", f"{PLUGIN_MODULE}:NOT_CALLABLE", "not a callable"),
    "wrongabi": ("afabric-wrongabi", f"{PLUGIN_MODULE}:wrong_abi", f"provider ABI {PROVIDER_ABI_MAJOR + 1}"),
    "nolib": ("afabric-nolib", f"{PLUGIN_MODULE}:no_library", "does not exist"),
    "raising": ("afabric-raising", f"{PLUGIN_MODULE}:raises", "the plugin's own bug"),
    "misnamed": ("afabric-misnamed", f"{PLUGIN_MODULE}:misnamed", "'something_else'"),
    # a second distribution offering a first-party name: both refused, both named
    "tcp": ("afabric-tcp-fork", "afabric_ofi:tcp", "offered by 2 distributions"),
}


def _install_fake_entry_points(monkeypatch: pytest.MonkeyPatch, *dists: FakeDist) -> None:
    """Make the registry read the installed entry points plus those of `dists`."""
    real = metadata.entry_points

    def entry_points(*, group: str) -> list[metadata.EntryPoint]:
        eps = list(real(group=group))
        for d in dists:
            eps += [ep for ep in d.entry_points if ep.group == group]
        return eps

    monkeypatch.setattr(registry, "entry_points", entry_points)
    registry.clear_cache()


@pytest.fixture
def broken(monkeypatch: pytest.MonkeyPatch, plugin_module: str) -> dict[str, tuple[str, str, str]]:
    dists = [FakeDist(dist, {name: value}) for name, (dist, value, _) in BROKEN.items()]
    dists.append(FakeDist("afabric-fine", {"fine": f"{plugin_module}:fine"}))
    _install_fake_entry_points(monkeypatch, *dists)
    return BROKEN


# ---- discovery ----


def test_discovery_lists_the_installed_providers() -> None:
    found = set(registry.names())
    assert found >= FIRST_PARTY
    if _sockets_installed():
        assert "sockets" in found
    for name in FIRST_PARTY:
        (entry,) = registry.entries()[name]
        assert entry.distribution == "afabric"
        assert entry.value == f"afabric_ofi:{name}"


def test_discovery_imports_nothing(broken: dict[str, tuple[str, str, str]]) -> None:
    """Listing reads metadata only: the (broken) plugin modules are not imported."""
    assert set(registry.names()) >= set(broken) | {"fine"}
    assert PLUGIN_MODULE not in sys.modules
    assert "afabric_no_such_module_xyz" not in sys.modules


def test_same_entry_seen_twice_is_not_a_conflict(monkeypatch: pytest.MonkeyPatch, plugin_module: str) -> None:
    """One distribution found twice on sys.path (same name and value) is one provider."""
    d = FakeDist("afabric-fine", {"fine": f"{plugin_module}:fine"})
    _install_fake_entry_points(monkeypatch, d, d)
    assert len(registry.entries()["fine"]) == 1
    assert registry.load("fine").name == "fine"


# ---- resolve ----


def test_auto_picks_the_best_available_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    """resolve("auto"): the network provider a default engine holds (cma and shm reach this
    host only, nvlink this node's GPUs: they sit beside it, see routes())."""
    avail = registry.probe_all()
    usable = [
        a
        for a in avail
        if a.available and a.spec is not None and a.spec.priority > 0 and a.spec.reach == "network"
    ]
    assert usable, "this machine should offer tcp at least"
    best = max(usable, key=lambda a: a.spec.priority if a.spec else 0)
    with caplog.at_level(logging.INFO, logger="afabric"):
        spec, sentence = registry.resolve("auto")
    assert spec.name == best.name
    assert sentence.startswith(f"auto picked {best.name} (")
    # what it passed over, and why
    for a in avail:
        if not a.available and a.spec is not None and a.spec.priority >= spec.priority:
            assert f"{a.name} unavailable" in sentence, a.name
        elif a.available and a is not best:
            assert f"ask for provider={a.name!r}" in sentence, a.name
    for name in registry.WELL_KNOWN:
        if name not in registry.names():
            assert f"{name} not installed" in sentence
    assert sentence in caplog.text  # said, not only returned


def test_auto_never_picks_priority_zero() -> None:
    spec, sentence = registry.resolve("auto")
    assert spec.priority > 0
    if "sockets" in registry.names() and registry.probe("sockets").available:
        assert "sockets is available but never picked by auto" in sentence


def test_explicit_name() -> None:
    spec, sentence = registry.resolve("shm")
    assert spec.name == "shm" and spec.fabric_provider == "shm"
    assert sentence.startswith("using shm (")


def test_unknown_name_lists_the_installed_ones() -> None:
    with pytest.raises(ProviderUnavailable) as ei:
        registry.resolve("infiniband-over-pigeons")
    assert isinstance(ei.value, LookupError)
    msg = str(ei.value)
    assert "'infiniband-over-pigeons' is not installed" in msg
    for name in registry.names():
        assert f"  {name}: " in msg, name
    assert "tcp: available" in msg
    with pytest.raises(ProviderUnavailable):
        registry.load("infiniband-over-pigeons")
    with pytest.raises(ProviderUnavailable):
        registry.probe("infiniband-over-pigeons")


def test_unavailable_name_says_why() -> None:
    if registry.probe("efa").available:
        pytest.skip("this machine has an EFA device")
    with pytest.raises(ProviderUnavailable) as ei:
        registry.resolve("efa")
    msg = str(ei.value)
    assert "'efa' is unavailable" in msg and "hint:" in msg
    assert "tcp: available" in msg


async def test_engine_with_unknown_provider() -> None:
    with pytest.raises(ProviderUnavailable, match="not installed"):
        afabric.Engine("infiniband-over-pigeons")


def test_env_override(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv(registry.ENV_PROVIDER, "shm")
    spec, sentence = registry.resolve("auto")
    assert spec.name == "shm"
    assert f"as {registry.ENV_PROVIDER} asks" in sentence
    # it replaces "auto" only: an explicit name wins
    assert registry.resolve("tcp")[0].name == "tcp"


def test_env_override_auto_is_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.ENV_PROVIDER, " auto ")
    assert registry.resolve("auto")[1].startswith("auto picked ")


def test_env_override_unknown_says_where_it_came_from(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(registry.ENV_PROVIDER, "nope")
    with pytest.raises(ProviderUnavailable, match=rf"'nope' \(from {registry.ENV_PROVIDER}=nope\)"):
        registry.resolve("auto")


# ---- broken plugins fail alone ----


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_plugin_fails_alone(name: str, broken: dict[str, tuple[str, str, str]]) -> None:
    dist, _, says = broken[name]
    with pytest.raises(PluginError) as ei:
        registry.load(name)
    msg = str(ei.value)
    assert dist in msg, f"the error does not name the distribution: {msg}"
    assert says in msg, msg
    if name == "tcp":  # a clash names both distributions
        assert "afabric 0.1.0 (afabric_ofi:tcp)" in msg
    # the provider is reported unavailable (with that reason), not raised from probe
    a = registry.probe(name)
    assert not a.available and dist in a.reason and a.spec is None
    # and every other provider still works
    for other in ("shm", "fine", *(["sockets"] if _sockets_installed() else [])):
        assert registry.load(other).name == other
    assert registry.resolve("shm")[0].name == "shm"
    with pytest.raises((PluginError, ProviderUnavailable)):
        registry.resolve(name)


def test_auto_survives_broken_plugins_and_names_them(broken: dict[str, tuple[str, str, str]]) -> None:
    avail = {a.name: a for a in registry.probe_all()}  # never raises
    for name in broken:
        assert not avail[name].available
    assert avail["fine"].available
    # tcp is refused (offered twice): a default engine opens what is left (cma for this
    # host, no network provider), and the sentence says what happened to tcp
    specs, sentence = registry.routes()
    assert [s.name for s in specs] == ["cma"]
    assert "no network provider is available" in sentence
    assert "tcp unavailable: provider 'tcp' is offered by 2 distributions" in sentence
    assert "afabric-tcp-fork" in sentence
    with pytest.raises(ProviderUnavailable, match="tcp: unavailable"):
        registry.resolve("auto")  # the network pick alone: none left


def test_entry_point_without_distribution(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = metadata.EntryPoint("orphan", "afabric_no_such_module_xyz:spec", registry.GROUP)
    real = metadata.entry_points
    monkeypatch.setattr(registry, "entry_points", lambda *, group: [*real(group=group), ep])
    registry.clear_cache()
    with pytest.raises(PluginError, match="<unknown distribution>"):
        registry.load("orphan")
    assert registry.load("tcp").name == "tcp"


def test_specs_are_cached() -> None:
    assert registry.load("tcp") is registry.load("tcp")
    assert registry.probe("tcp") is registry.probe("tcp")
    first = registry.load("tcp")
    registry.clear_cache()
    assert registry.load("tcp") is not first


def test_first_party_specs() -> None:
    specs = {n: registry.load(n) for n in FIRST_PARTY}
    assert specs["efa"].priority > specs["tcp"].priority > specs["shm"].priority > 0
    for spec in specs.values():
        assert isinstance(spec, ProviderSpec)
        assert spec.abi_major == PROVIDER_ABI_MAJOR
        assert Path(spec.library).is_absolute() and Path(spec.library).is_file()
    assert specs["tcp"].bind_addr == "127.0.0.1"


# ---- afabric info ----


def _check_info(
    info: dict[str, object], extra: frozenset[str] = frozenset(), tcp_ok: bool = True
) -> dict[str, dict[str, object]]:
    providers = info["providers"]
    assert isinstance(providers, list)
    by_name = {p["name"]: p for p in providers}
    expected = FIRST_PARTY | OTHER_FIRST_PARTY | ({"sockets"} if _sockets_installed() else set()) | extra
    assert set(by_name) == expected
    for p in providers:
        assert isinstance(p["available"], bool)
        assert p["available"] == (p["reason"] == ""), p
        assert isinstance(p["nics"], list)
        assert bool(p["nics"]) == p["available"], p
    if tcp_ok:
        assert by_name["tcp"]["available"] is True
        nics = by_name["tcp"]["nics"]
        assert isinstance(nics, list)
        assert all(re.fullmatch(r"\d+\.\d+\.\d+", n["lib_version"]) for n in nics), nics
        assert by_name["tcp"]["distribution"] == "afabric"
    if "sockets" in by_name:
        assert by_name["sockets"]["distribution"] == "afabric-sockets"
        assert by_name["sockets"]["priority"] == 0
    priorities = [p["priority"] if p["priority"] is not None else -1 for p in providers]
    assert priorities == sorted(priorities, reverse=True)
    return by_name


def test_info_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["shim"]["loaded"] is True
    _check_info(info)
    assert info["thp"] in ("always", "madvise", "never", "")
    auto = info["auto"]
    specs, _ = registry.routes()
    assert auto["transports"] == [s.name for s in specs] and auto["provider"] == "+".join(auto["transports"])
    assert auto["transports"][-1] == registry.resolve("auto")[0].name  # the network one, last
    assert auto["why"].startswith(f"auto opened {auto['transports'][0]} for ")


def test_info_json_with_broken_plugins(
    capsys: pytest.CaptureFixture[str], broken: dict[str, tuple[str, str, str]]
) -> None:
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    by_name = _check_info(info, extra=frozenset(broken) | {"fine"}, tcp_ok=False)
    assert by_name["tcp"]["distribution"] == "afabric, afabric-tcp-fork"
    for name, (dist, _, _) in broken.items():
        assert by_name[name]["available"] is False
        assert dist in str(by_name[name]["reason"])
    assert info["auto"]["provider"] == "cma"


def test_info_text(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AFABRIC_LIBFABRIC", raising=False)
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "tcp: available  [distribution afabric, priority 10]" in out
    # the libfabric under each libfabric provider (the system's: Debian's is 1.17.0)
    assert re.search(r"libfabric provider: tcp;ofi_rxm \(libfabric 1\.\d+\.\d+\)\n", out), out
    assert re.search(r"libfabric provider: shm \(libfabric 1\.\d+\.\d+\)\n", out), out
    if "cma: available" in out:
        assert "libfabric provider: cma;process_vm_writev\n" in out  # no libfabric under it
    assert "efa: " in out and "auto opened " in out
    assert 'a default engine (provider="auto") opens: cma, tcp' in out
    if _sockets_installed():
        assert "sockets: available  [distribution afabric-sockets, priority 0]" in out
    # the kernel's huge page setting, which cma's copy speed depends on (docs/providers/cma.md)
    setting = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    thp = re.search(r"\[(\w+)\]", setting.read_text() if setting.exists() else "")
    assert f"transparent huge pages: {thp.group(1) if thp else 'none'}: " in out, out


def test_info_command_line() -> None:
    """The real command, in a fresh interpreter (what a user or a script runs)."""
    proc = subprocess.run(
        [sys.executable, "-m", "afabric.cli", "info", "--json"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    _check_info(json.loads(proc.stdout))


def test_info_reports_errors_as_exit_status(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom() -> list[registry.Availability]:
        raise PluginError("the registry exploded")

    monkeypatch.setattr(registry, "probe_all", boom)
    assert cli.main(["info"]) == 1
    assert "afabric: error: the registry exploded" in capsys.readouterr().err
    assert issubclass(PluginError, AfabricError)
