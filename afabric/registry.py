"""Provider discovery, loading, probing and the choice behind ``provider="auto"``.

Providers are plugins: entry points in the group ``afabric.providers`` (first-party ones
exactly like third-party ones). Discovery reads installed metadata only and imports
nothing; a plugin is imported the first time it is used, checked (it must return a
:class:`~afabric.provider.ProviderSpec` of this ABI major, named like its entry point,
whose library exists) and cached. A broken plugin fails alone, with a
:class:`~afabric.errors.PluginError` naming its distribution; the same name offered by
two distributions is an error naming both (never "first one wins").

``routes()`` is what a default engine (``provider="auto"``) opens: the best available
provider of each reach (same host, same node, network), saying which and why in one
sentence that is also logged on the ``afabric`` logger: there is no silent fallback to a
slow transport. ``resolve(name)`` is one provider by name.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points

from . import _native
from .errors import AfabricError, PluginError, ProviderUnavailable
from .provider import PROVIDER_ABI_MAJOR, ProviderSpec

__all__ = [
    "GROUP",
    "Availability",
    "PluginEntry",
    "clear_cache",
    "entries",
    "env_provider",
    "load",
    "names",
    "probe",
    "probe_all",
    "resolve",
    "routes",
]

GROUP = "afabric.providers"
# What a provider can reach, narrowest first: a default engine prefers the narrowest
# transport that reaches a peer (shim/route.c).
REACHES = tuple(_native.REACHES)
_REACH_TEXT = {"host": "this host's processes", "node": "this node's GPUs", "network": "any host"}
ENV_PROVIDER = "AFABRIC_PROVIDER"

# Providers that outrank the software ones when present; named in auto's explanation when
# no installed plugin offers them, so "why not the fast one?" has an answer.
WELL_KNOWN = ("efa", "verbs")

log = logging.getLogger("afabric")


@dataclass(frozen=True)
class PluginEntry:
    """One entry point of the group, as read from metadata (nothing imported)."""

    name: str
    value: str
    """``module:attribute`` of the spec function."""
    distribution: str
    version: str
    entry_point: EntryPoint = field(repr=False, compare=False)


@dataclass(frozen=True)
class Availability:
    """Whether a provider can be used on this machine, and why not if it cannot."""

    name: str
    available: bool
    reason: str
    """Empty when available; otherwise the cause and the provider's hint."""
    provider: str = ""
    """libfabric's (or the library's) full provider name, e.g. ``tcp;ofi_rxm``."""
    nics: list[_native.NicInfo] = field(default_factory=list)
    spec: ProviderSpec | None = None
    distribution: str = ""

    def summary(self) -> str:
        """``tcp: available (tcp;ofi_rxm, 1 NIC: lo)`` or ``efa: unavailable: ...``."""
        if self.available:
            return f"{self.name}: available ({_nic_phrase(self)})"
        return f"{self.name}: unavailable: {self.reason}"


_lock = threading.RLock()
_entries: dict[str, list[PluginEntry]] | None = None
_specs: dict[str, ProviderSpec] = {}
_probes: dict[str, Availability] = {}


def clear_cache() -> None:
    """Forget discovered entry points, loaded specs and probe results (for tests)."""
    global _entries
    with _lock:
        _entries = None
        _specs.clear()
        _probes.clear()


def _dist_of(ep: EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown distribution>", ""
    try:
        return str(dist.metadata["Name"]), str(dist.version)
    except Exception:  # noqa: BLE001 - malformed metadata must not break discovery
        return "<unknown distribution>", ""


def entries() -> dict[str, list[PluginEntry]]:
    """Every provider name found in metadata -> the entries offering it (2+ = conflict).

    Reads metadata only; imports no plugin.
    """
    global _entries
    with _lock:
        if _entries is None:
            found: dict[str, list[PluginEntry]] = {}
            for ep in entry_points(group=GROUP):
                dist, version = _dist_of(ep)
                entry = PluginEntry(ep.name, ep.value, dist, version, ep)
                same = found.setdefault(ep.name, [])
                if not any(e.distribution == dist and e.value == ep.value for e in same):
                    same.append(entry)
            _entries = found
        return dict(_entries)


def names() -> list[str]:
    """Provider names found, sorted."""
    return sorted(entries())


def _distributions(name: str) -> str:
    return ", ".join(e.distribution for e in entries().get(name, []))


def _entry(name: str) -> PluginEntry:
    found = entries().get(name)
    if not found:
        raise ProviderUnavailable(
            f"provider {name!r} is not installed (installed: {', '.join(names()) or 'none'})"
        )
    if len(found) > 1:
        offers = "; ".join(f"{e.distribution} {e.version} ({e.value})" for e in found)
        raise PluginError(
            f"provider {name!r} is offered by {len(found)} distributions: {offers}; "
            f"uninstall all but one"
        )
    return found[0]


def load(name: str) -> ProviderSpec:
    """Import the plugin for ``name`` (first use only), check its spec and cache it.

    Raises ProviderUnavailable for an unknown name and PluginError, naming the
    distribution, for a plugin that is broken or clashes with another.
    """
    with _lock:
        cached = _specs.get(name)
        if cached is not None:
            return cached
        entry = _entry(name)
        where = f"provider plugin {name!r} ({entry.value}) from distribution {entry.distribution}"
        try:
            obj = entry.entry_point.load()
        except Exception as e:
            raise PluginError(f"{where}: cannot import it: {type(e).__name__}: {e}") from e
        if not callable(obj):
            raise PluginError(f"{where}: the entry point is {type(obj).__name__}, not a callable")
        factory: Callable[[], object] = obj
        try:
            spec = factory()
        except Exception as e:
            raise PluginError(f"{where}: calling it raised {type(e).__name__}: {e}") from e
        if not isinstance(spec, ProviderSpec):
            raise PluginError(
                f"{where}: returned {type(spec).__name__}, not afabric.provider.ProviderSpec"
            )
        if spec.abi_major != PROVIDER_ABI_MAJOR:
            raise PluginError(
                f"{where}: built for provider ABI {spec.abi_major}, this afabric speaks "
                f"{PROVIDER_ABI_MAJOR}; upgrade the plugin or afabric"
            )
        if spec.name != name:
            raise PluginError(f"{where}: its spec is named {spec.name!r}, the entry point {name!r}")
        if spec.reach not in REACHES:
            raise PluginError(f"{where}: reach {spec.reach!r} is not one of {', '.join(REACHES)}")
        if not os.path.isabs(spec.library) or not os.path.isfile(spec.library):
            raise PluginError(
                f"{where}: native library {spec.library!r} does not exist "
                f"(reinstall {entry.distribution})"
            )
        _specs[name] = spec
        return spec


def _with_hint(reason: str, spec: ProviderSpec | None) -> str:
    if spec is not None and spec.hint:
        return f"{reason} (hint: {spec.hint})"
    return reason


def probe(name: str) -> Availability:
    """Load ``name`` and ask its library which NICs it sees; cached per process.

    Never raises for a provider that is installed but broken or unusable: that gives
    ``available=False`` with the reason. An unknown name raises ProviderUnavailable.
    """
    with _lock:
        cached = _probes.get(name)
        if cached is not None:
            return cached
        found = entries().get(name)
        if not found:
            raise ProviderUnavailable(
                f"provider {name!r} is not installed (installed: {', '.join(names()) or 'none'})"
            )
        dist = _distributions(name)
        result: Availability
        try:
            spec = load(name)
        except AfabricError as e:
            result = Availability(name, False, str(e), distribution=dist)
        else:
            try:
                cfg = _native.make_config(
                    library=spec.library,
                    provider_name=spec.name,
                    fabric_provider=spec.fabric_provider,
                    bind_addr=spec.bind_addr,
                )
                lib_name, nics = _native.probe(cfg)
            except AfabricError as e:
                result = Availability(name, False, _with_hint(str(e), spec), spec=spec, distribution=dist)
            else:
                # The NICs carry libfabric's full name ("tcp;ofi_rxm"); the probe's own name
                # is the library's ("ofi"), kept only when no NIC says more.
                full = ", ".join(dict.fromkeys(n.provider for n in nics if n.provider))
                full = full or (lib_name if nics else "")
                if nics:
                    result = Availability(name, True, "", full, list(nics), spec, dist)
                else:
                    result = Availability(
                        name, False, _with_hint(f"no {spec.fabric_provider} NIC found", spec),
                        full, [], spec, dist,
                    )
        _probes[name] = result
        return result


def probe_all() -> list[Availability]:
    """Availability of every installed provider: highest priority first, then by name."""
    out = [probe(n) for n in names()]
    out.sort(key=lambda a: (-(a.spec.priority if a.spec is not None else -1), a.name))
    return out


def _nic_phrase(a: Availability) -> str:
    nics = ", ".join(n.name for n in a.nics)
    count = f"{len(a.nics)} NIC" + ("" if len(a.nics) == 1 else "s")
    head = f"{a.provider}, " if a.provider else ""
    return f"{head}{count}: {nics}" if nics else f"{head}{count}"


def _listing(avail: list[Availability]) -> str:
    return "\n".join(f"  {a.summary()}" for a in avail) or "  (no provider installed)"


def _scope_note(a: Availability) -> str:
    """Why an available provider other than the pick was not picked."""
    assert a.spec is not None
    if a.spec.priority <= 0:
        return f"{a.name} is available but never picked by auto — ask for provider={a.name!r}"
    if a.spec.reach != "network":
        return f"{a.name} reaches {_REACH_TEXT[a.spec.reach]} only — ask for provider={a.name!r}"
    return f"{a.name} is also available (lower priority) — ask for provider={a.name!r}"


def _resolve_auto() -> tuple[ProviderSpec, str]:
    _native.shim()  # every provider needs it: its failure once, not once per provider
    avail = probe_all()
    usable = [a for a in avail if a.available and a.spec is not None and a.spec.priority > 0
              and a.spec.reach == "network"]
    if not usable:
        raise ProviderUnavailable(
            "provider='auto' found no usable provider (priority > 0 and available):\n" + _listing(avail)
        )
    best = usable[0]
    assert best.spec is not None
    bp = best.spec.priority
    # Unavailable providers that would have won (or whose plugin is broken), then the
    # well-known fast ones nobody installed.
    passed = [
        f"{a.name} unavailable: {a.reason}"
        for a in avail
        if not a.available and (a.spec is None or a.spec.priority >= bp)
    ]
    installed = set(names())
    passed += [f"{n} not installed" for n in WELL_KNOWN if n not in installed]
    others = [_scope_note(a) for a in avail if a is not best and a.available and a.spec is not None]
    sentence = f"auto picked {best.name} ({_nic_phrase(best)})"
    if passed:
        sentence += ": " + ", ".join(passed)
    if others:
        sentence += "; " + "; ".join(others)
    return best.spec, sentence


def env_provider() -> str | None:
    """$AFABRIC_PROVIDER when it names a provider (it replaces "auto"), else None."""
    env = os.environ.get(ENV_PROVIDER, "").strip()
    return env if env and env != "auto" else None


def routes() -> tuple[list[ProviderSpec], str]:
    """The transports of a default engine and a sentence saying why.

    Per reach (host, node, network), the highest-priority available provider with priority
    > 0, narrowest reach first (the order the engine prefers them in). Providers passed over
    (unavailable, outranked, never opened by auto) are named in the sentence, which is
    logged on the ``afabric`` logger. Raises ProviderUnavailable when no provider of any
    reach is usable.
    """
    _native.shim()
    avail = probe_all()
    picked: list[Availability] = []
    for reach in REACHES:
        usable = [a for a in avail if a.available and a.spec is not None and a.spec.priority > 0
                  and a.spec.reach == reach]
        if usable:
            picked.append(usable[0])
    if not picked:
        raise ProviderUnavailable(
            "provider='auto' found no usable provider (priority > 0 and available):\n" + _listing(avail)
        )
    specs = [a.spec for a in picked if a.spec is not None]
    opened = ", ".join(
        f"{a.name} for {_REACH_TEXT[s.reach]} ({_nic_phrase(a)})" for a, s in zip(picked, specs, strict=True)
    )
    passed = [
        f"{a.name} unavailable: {a.reason}"
        for a in avail
        if not a.available and (a.spec is None or a.spec.priority > 0)
    ]
    installed = set(names())
    passed += [f"{n} not installed" for n in WELL_KNOWN if n not in installed]
    others = [
        f"{a.name} (outranked)" if a.spec.priority > 0 else f"{a.name} (never opened by auto)"
        for a in avail
        if a.available and a.spec is not None and a not in picked
    ]
    sentence = f"auto opened {opened}"
    if not any(s.reach == "network" for s in specs):
        sentence += "; no network provider is available: only this host's peers are reachable"
    if passed:
        sentence += "; passed over: " + ", ".join(passed)
    if others:
        sentence += "; also available: " + ", ".join(others) + " (ask for one by name)"
    log.info("%s", sentence)
    return specs, sentence


def resolve(requested: str = "auto") -> tuple[ProviderSpec, str]:
    """The provider to use for ``Engine(provider=requested)`` and a sentence saying why.

    ``"auto"`` (which ``$AFABRIC_PROVIDER`` may replace by a name) picks the highest-priority
    available network provider with priority > 0 (the one a default engine holds for peers
    on other hosts, beside its same-host ones: :func:`routes`) and logs the sentence on the
    ``afabric`` logger.
    An explicit name that is unknown or unavailable raises ProviderUnavailable listing
    every installed provider and its availability.
    """
    origin = ""
    if requested == "auto":
        env = os.environ.get(ENV_PROVIDER, "").strip()
        if env and env != "auto":
            requested, origin = env, f" (from {ENV_PROVIDER}={env})"
    if requested == "auto":
        spec, sentence = _resolve_auto()
        log.info("%s", sentence)
        return spec, sentence
    _native.shim()  # ShimLoadError: every provider needs it, so it is the one thing to say
    if requested not in entries():
        raise ProviderUnavailable(
            f"provider {requested!r}{origin} is not installed; installed providers:\n" + _listing(probe_all())
        )
    a = probe(requested)
    if not a.available or a.spec is None:
        raise ProviderUnavailable(
            f"provider {requested!r}{origin} is unavailable: {a.reason}\ninstalled providers:\n"
            + _listing(probe_all())
        )
    sentence = f"using {a.name} ({_nic_phrase(a)})" + (f", as {ENV_PROVIDER} asks" if origin else "")
    log.debug("%s", sentence)
    return a.spec, sentence
