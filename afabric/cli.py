"""The ``afabric`` command: ``afabric info``, ``afabric bench ...`` and ``afabric weights plan``.

``info`` lists the installed providers (from the ``afabric.providers`` entry points),
whether each is usable here and why not, the NICs each sees, what ``provider="auto"``
would pick, GPUs and NUMA nodes. Every other subcommand (``bench ...``, ``weights``) lives
in its own module, registered from one table (``_MODULE_COMMANDS``): the module declares
its options (``HELP``, ``add_arguments``) and runs in its ``main``.

What every command does the same way (:mod:`afabric.bench.harness`): options and output
paths are checked before anything runs, and a missing optional package (torch, cupy,
matplotlib, uvloop) is named with how to install it: exit status 2 for all of these, as
for an unknown option (reported with the usage of the subcommand it was given to), an
argument out of range or a ``--provider`` that is not installed or not usable here;
``--json -`` writes the JSON document to stdout and the report to stderr; progress goes to
stderr (a bar on a terminal, plain lines otherwise); a failed run exits 1 with one line.
SIGINT (Ctrl-C), SIGTERM and SIGHUP stop a run cleanly (engines closed, child processes
stopped, nothing left in /dev/shm): one line, exit status 128 + the signal's number
(:mod:`afabric.bench.interrupt`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from pathlib import Path
from typing import TextIO, TypedDict

from . import _native, registry
from .bench import harness, interrupt
from .bench.harness import parse_size
from .errors import AfabricError

__all__ = ["main", "parse_size"]


# ---- what `afabric info --json` prints (the keys are an interface: scripts read them) ----


class GpuJson(TypedDict):
    index: int
    name: str
    pci: str
    numa_node: int


class NumaJson(TypedDict):
    node: int
    cpus: str
    mem_bytes: int


class _ShimJsonBase(TypedDict):
    loaded: bool


class ShimJson(_ShimJsonBase, total=False):
    path: str  # when loaded
    error: str  # when not


class NicJson(TypedDict):
    name: str
    fabric: str
    provider: str
    pci: str
    link_speed_bps: int
    numa_node: int
    lib_version: str


class ProviderJson(TypedDict):
    name: str
    distribution: str
    available: bool
    reason: str
    provider: str
    priority: int | None
    library: str | None
    fabric_provider: str | None
    bind_addr: str | None
    hint: str
    description: str
    options: dict[str, str]
    nics: list[NicJson]


class AutoJson(TypedDict):
    provider: str | None  # the transports a default engine opens, "cma+tcp" (None: nothing usable)
    transports: list[str]
    why: str


class InfoJson(TypedDict):
    afabric: str
    python: str
    shim: ShimJson
    providers: list[ProviderJson]
    auto: AutoJson
    gpus: list[GpuJson]
    numa: list[NumaJson]
    thp: str
    """Transparent huge pages (/sys/kernel/mm/transparent_hugepage/enabled): always,
    madvise or never; "" where the kernel has none."""


def _speed(bps: int) -> str:
    if bps <= 0:
        return "?"
    if bps >= 10**9:
        return f"{bps / 1e9:g} Gb/s"
    return f"{bps / 1e6:g} Mb/s"


# ---- host facts (sysfs / procfs) ----


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _pci_numa(bus: str) -> int:
    text = _read(Path("/sys/bus/pci/devices") / bus.lower() / "numa_node")
    try:
        return int(text)
    except ValueError:
        return -1


def gpus() -> list[GpuJson]:
    """NVIDIA GPUs from /proc/driver/nvidia/gpus (nvidia-smi when /proc lacks them)."""
    out: list[GpuJson] = []
    root = Path("/proc/driver/nvidia/gpus")
    if root.is_dir():
        for d in sorted(root.iterdir()):
            fields: dict[str, str] = {}
            for line in _read(d / "information").splitlines():
                key, sep, value = line.partition(":")
                if sep:
                    fields[key.strip()] = value.strip()
            bus = fields.get("Bus Location", d.name)
            out.append({
                "index": int(fields.get("Device Minor", len(out))),
                "name": fields.get("Model", "NVIDIA GPU"),
                "pci": bus,
                "numa_node": _pci_numa(bus),
            })
        return out
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return out
    try:
        proc = subprocess.run(
            [smi, "--query-gpu=index,name,pci.bus_id", "--format=csv,noheader"],
            check=False, capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired):
        return out
    if proc.returncode != 0:
        return out
    for line in proc.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit():
            bus = parts[2][-12:].lower()  # nvidia-smi prints 00000000:3B:00.0
            out.append({"index": int(parts[0]), "name": parts[1], "pci": bus, "numa_node": _pci_numa(bus)})
    return out


def numa_nodes() -> list[NumaJson]:
    """NUMA nodes from /sys/devices/system/node: id, CPU list, memory."""
    out: list[NumaJson] = []
    root = Path("/sys/devices/system/node")
    if not root.is_dir():
        return out
    nodes = [d for d in root.iterdir() if re.fullmatch(r"node\d+", d.name)]
    for d in sorted(nodes, key=lambda p: int(p.name[4:])):
        mem_kib = 0
        for line in _read(d / "meminfo").splitlines():
            if "MemTotal:" in line:
                mem_kib = int(line.split()[-2])
        out.append({"node": int(d.name[4:]), "cpus": _read(d / "cpulist"), "mem_bytes": mem_kib * 1024})
    return out


def thp_mode() -> str:
    """The kernel's transparent huge page setting: the bracketed word of
    /sys/kernel/mm/transparent_hugepage/enabled ("" when absent)."""
    m = re.search(r"\[(\w+)\]", _read(Path("/sys/kernel/mm/transparent_hugepage/enabled")))
    return m.group(1) if m else ""


_THP_NOTE = {  # why it matters: cma's copies into huge pages ran 2-3x faster (docs/providers/cma.md)
    "always": "any 2 MiB-aligned anonymous memory may get them, afabric.host_buffer's included",
    "madvise": "afabric.host_buffer's memory gets them; torch's, and the ends of numpy's, do not",
    "never": "off: cma copies into 4 KiB pages only (2-3x slower than into huge pages)",
    "": "not in this kernel",
}


# ---- info ----


def _version() -> str:
    try:
        return metadata.version("afabric")
    except metadata.PackageNotFoundError:
        return "(not installed)"


def _shim_state() -> ShimJson:
    try:
        s = _native.shim()
    except AfabricError as e:
        return {"loaded": False, "error": str(e)}
    return {"loaded": True, "path": s.path}


def _nic_json(n: _native.NicInfo) -> NicJson:
    return {
        "name": n.name,
        "fabric": n.fabric,
        "provider": n.provider,
        "pci": n.pci,
        "link_speed_bps": n.link_speed_bps,
        "numa_node": n.numa_node,
        "lib_version": n.lib_version,
    }


def _availability_json(a: registry.Availability) -> ProviderJson:
    spec = a.spec
    return {
        "name": a.name,
        "distribution": a.distribution,
        "available": a.available,
        "reason": a.reason,
        "provider": a.provider,
        "priority": spec.priority if spec is not None else None,
        "library": spec.library if spec is not None else None,
        "fabric_provider": spec.fabric_provider if spec is not None else None,
        "bind_addr": spec.bind_addr if spec is not None else None,
        "hint": spec.hint if spec is not None else "",
        "description": spec.description if spec is not None else "",
        "options": dict(spec.options) if spec is not None else {},
        "nics": [_nic_json(n) for n in a.nics],
    }


def collect_info() -> InfoJson:
    """Everything ``afabric info`` shows, as plain data."""
    providers = registry.probe_all()
    auto: AutoJson
    try:
        specs, sentence = registry.routes()
        names = [s.name for s in specs]
        auto = {"provider": "+".join(names), "transports": names, "why": sentence}
    except AfabricError as e:
        auto = {"provider": None, "transports": [], "why": str(e)}
    return {
        "afabric": _version(),
        "python": sys.version.split()[0],
        "shim": _shim_state(),
        "providers": [_availability_json(a) for a in providers],
        "auto": auto,
        "gpus": gpus(),
        "numa": numa_nodes(),
        "thp": thp_mode(),
    }


def _print_info(info: InfoJson) -> None:
    print(f"afabric {info['afabric']} (Python {info['python']})")
    shim = info["shim"]
    print(f"shim: {shim['path']}" if shim["loaded"] else f"shim: NOT LOADED: {shim['error']}")
    print()
    print("providers:")
    if not info["providers"]:
        print("  none installed (no entry points in the group 'afabric.providers')")
    for p in info["providers"]:
        state = "available" if p["available"] else "unavailable"
        prio = p["priority"] if p["priority"] is not None else "-"
        print(f"  {p['name']}: {state}  [distribution {p['distribution']}, priority {prio}]")
        if p["provider"]:
            print(f"    libfabric provider: {p['provider']}{_library(p)}")
        if p["bind_addr"]:
            print(f"    binds: {p['bind_addr']}")
        for n in p["nics"]:
            numa = n["numa_node"] if n["numa_node"] >= 0 else "?"
            print(
                f"    NIC {n['name']}: fabric {n['fabric'] or '?'}, numa {numa}, "
                f"pci {n['pci'] or '-'}, speed {_speed(n['link_speed_bps'])}"
            )
        if not p["available"]:
            # the shim's failure is every provider's: said once, above
            print(f"    why: {'the shim is not loaded (above)' if not shim['loaded'] else p['reason']}")
    print()
    auto = info["auto"]
    if not shim["loaded"]:
        print("auto: nothing usable: the shim is not loaded (above)")
    elif auto["provider"]:
        print(f"a default engine (provider=\"auto\") opens: {', '.join(auto['transports'])}")
        print(auto["why"])
    else:
        print(f"auto: nothing usable: {auto['why']}")
    print()
    print("GPUs:" + ("" if info["gpus"] else " none"))
    for g in info["gpus"]:
        numa = g["numa_node"] if g["numa_node"] >= 0 else "?"
        print(f"  GPU {g['index']}: {g['name']}, pci {g['pci']}, numa {numa}")
    print("NUMA nodes:" + ("" if info["numa"] else " none (no /sys/devices/system/node)"))
    for node in info["numa"]:
        print(f"  node {node['node']}: cpus {node['cpus']}, memory {node['mem_bytes'] / 2**30:.1f} GiB")
    thp = info["thp"]
    print(f"transparent huge pages: {thp or 'none'}: {_THP_NOTE.get(thp, _THP_NOTE[''])}")


def _library(p: ProviderJson) -> str:
    """" (libfabric 1.17.0)" for a provider on libfabric: shm works only between processes
    of one libfabric version (docs/providers/shm.md), so which one each environment loads is worth seeing."""
    versions = ", ".join(dict.fromkeys(n["lib_version"] for n in p["nics"] if n["lib_version"]))
    if not p["fabric_provider"] or not versions:
        return ""
    path = os.environ.get("AFABRIC_LIBFABRIC")
    return f" (libfabric {versions}" + (f", AFABRIC_LIBFABRIC={path})" if path else ")")


def _cmd_info(ns: argparse.Namespace) -> int:
    info = collect_info()
    if ns.json:
        json.dump(info, sys.stdout, indent=2)
        print()
    else:
        _print_info(info)
    return 0


# ---- bench ----


@contextlib.contextmanager
def _json_to_stdout(ns: argparse.Namespace) -> Iterator[None]:
    """For ``--json -``: standard output carries the JSON document only. The report (and
    anything child processes print) goes to stderr; the document is written to a copy of
    the original stdout kept in ``ns.json_stream``."""
    if getattr(ns, "json", None) != "-":
        yield
        return
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
        err = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # stdout is not a file (called in-process)
        ns.json_stream = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    saved = os.dup(fd)
    stream: TextIO = os.fdopen(saved, "w")
    ns.json_stream = stream
    os.dup2(err, fd)  # children inherit fd 1: their prints go to stderr too
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        stream.flush()
        os.dup2(saved, fd)
        stream.close()


def _run_bench(module: str, ns: argparse.Namespace) -> int:
    command = "afabric " + " ".join(
        str(getattr(ns, k)) for k in ("command", "bench") if getattr(ns, k, None)
    )
    harness.check_outputs(ns, command)  # before anything runs, not after it
    harness.check_provider(ns)
    if getattr(ns, "loop", None) == "uvloop":
        harness.require(f"{command} --loop uvloop", "uvloop")
    # Imported here, on use only: the benchmark pulls in numpy and the engine.
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name):
            raise
        print(f"afabric: error: this install has no benchmark module ({e})", file=sys.stderr)
        return 2
    run: Callable[[argparse.Namespace], int] = mod.main
    with _json_to_stdout(ns):
        return int(run(ns))


# Every subcommand but ``info`` (this module's own: it reports, it runs nothing) is registered
# from this one table: ``(parent, name, module, {provider: module})``. Each module defines
# ``HELP`` (one line), ``add_arguments(parser)`` and ``main(ns) -> int``, and imports nothing
# heavy at module level (the parser is built on every ``afabric`` call); the last field
# names another module whose ``main`` runs instead when ``--provider`` is that provider.
_MODULE_COMMANDS: tuple[tuple[str, str, str, dict[str, str]], ...] = (
    # GPU memory on both sides, against the CUDA peer copy:
    ("bench", "p2p", "afabric.bench.p2p", {"nvlink": "afabric.bench.p2p_nvlink"}),
    ("bench", "trigger", "afabric.bench.trigger", {}),
    ("bench", "overhead", "afabric.bench.overhead", {}),
    ("bench", "report", "afabric.bench.report", {}),
    ("bench", "kvcache", "afabric.bench.kvcache", {}),
    ("bench", "soak", "afabric.bench.soak", {}),
    ("bench", "moe", "afabric.bench.moe", {}),
    ("", "weights", "afabric.weights.cli", {}),
    ("bench", "weights", "afabric.bench.weights", {}),
    ("bench", "compat", "afabric.bench.compat", {}),
)


def _add_module_commands(parents: dict[str, argparse._SubParsersAction[argparse.ArgumentParser]]) -> None:
    for parent, name, module, by_provider in _MODULE_COMMANDS:
        mod = importlib.import_module(module)
        p = parents[parent].add_parser(name, help=mod.HELP)
        mod.add_arguments(p)
        p.set_defaults(
            func=lambda ns, _m=module, _v=by_provider: _run_bench(_v.get(getattr(ns, "provider", ""), _m), ns)
        )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="afabric", description="Portable point-to-point RDMA for asyncio.")
    ap.add_argument("-V", "--version", action="version", version=f"afabric {_version()}")
    ap.add_argument("-v", "--verbose", action="store_true", help="log afabric's decisions (INFO) to stderr")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    info = sub.add_parser("info", help="providers, NICs, GPUs and NUMA nodes on this machine")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_cmd_info)

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    _add_module_commands({"": sub, "bench": bsub})
    return ap


def _chosen(p: argparse.ArgumentParser, ns: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost subcommand's parser that ``ns`` was parsed with ("afabric bench p2p")."""
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            name = getattr(ns, action.dest, None)
            if isinstance(name, str) and name in action.choices:
                return _chosen(action.choices[name], ns)
    return p


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """parse_args, except that an unknown option is reported with the usage of the
    subcommand it was given to (argparse's own: the top-level usage); exits 2."""
    ap = _parser()
    ns, extra = ap.parse_known_args(argv)
    if extra:
        _chosen(ap, ns).error(f"unrecognized arguments: {' '.join(extra)}")
    return ns


def _interrupted(signum: int) -> int:
    name = signal.Signals(signum).name
    print(f"afabric: interrupted ({name}): stopped, engines closed", file=sys.stderr)
    return interrupt.exit_status(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``afabric`` console script; returns the exit status."""
    ns = _parse(argv)
    ns.argv = list(sys.argv[1:] if argv is None else argv)  # recorded in benchmark results
    if ns.verbose:
        logging.basicConfig(format="%(name)s: %(message)s")
        logging.getLogger("afabric").setLevel(logging.INFO)
    with interrupt.handled():
        try:
            rc: int = ns.func(ns)
        except KeyboardInterrupt:
            return _interrupted(interrupt.received() or signal.SIGINT)
        except harness.CommandError as e:
            print(f"afabric: error: {e}", file=sys.stderr)
            return e.exit_status
        except AfabricError as e:
            # what a signal caused (a child that stopped first, a transfer to it) is no error
            if interrupt.received() is not None:
                return _interrupted(interrupt.received() or signal.SIGINT)
            print(f"afabric: error: {e}", file=sys.stderr)
            return 1
        except BrokenPipeError:  # `afabric info | head`: stop quietly, as other tools do
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            return 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
