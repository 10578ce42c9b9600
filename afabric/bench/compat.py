"""`afabric bench compat`: one batch-write workload through serving frameworks' transfer APIs.

Every system is a column: Mooncake's own ``TransferEngine`` (when ``pip install
mooncake-transfer-engine-non-cuda`` installed it; otherwise the column is skipped, saying
so) and afabric.compat.mooncake, the same API over afabric; NIXL's own ``nixl_agent`` (when
``pip install nixl-cu12`` installed it) and afabric.compat.nixl (:mod:`.compat_nixl`). More
systems join by adding a :class:`System` to :data:`SYSTEMS`.

The workload, per size S (64 KiB, 1 MiB, 16 MiB by default): batches of ``batch_bytes // S``
writes of S bytes each (64 MiB a batch), from one registered buffer of an initiator process
into one of a target process, each batch one blocking call (``batch_transfer_sync_write``).
A system's initiator and target are processes of their own (spawned, so two systems never
share one), on this host, over the protocol ``--protocol`` names (tcp by default). Reported:
GB/s of the median batch and the median batch's time. After the timed batches the target's
buffer is compared with what was written (``checked``). The NIXL columns post each size's
batch as one prepared transfer of ``batch_bytes // S`` descriptors and also time vLLM's READ
of 64 x 2 x 100 block descriptors (a row of its own). Nothing here asserts speed.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from . import compat_nixl, harness, raw

HELP = (
    "one batch-write workload through Mooncake's and NIXL's own libraries and afabric.compat "
    "(and vLLM's READ of many block descriptors through NIXL's API)"
)
SIZES = (64 << 10, 1 << 20, 16 << 20)
BATCH_BYTES = 64 << 20
ITERATIONS = 20
QUICK_ITERATIONS = 2
WARMUP = 1  # batches before the timed ones (connections, first-touch of pages)


@dataclass(frozen=True)
class System:
    """One column of the table.

    ``unavailable()`` returns why the system cannot run here (then its column says so), or
    None. ``target(conn, params)`` runs in a process of its own: it sets up, sends what the
    initiator needs (``conn.send``), and serves until it receives ``"stop"``, then answers
    ``("sha", sha256 hex of its first n bytes)`` for a received ``("sha", n)``. ``initiator(conn,
    params, target_info)`` runs in another process: it writes the workload and sends
    ``{size: [seconds per batch, ...]}`` then ``sha256 hex`` of what it wrote. ``params``:
    ``sizes``, ``iterations``, ``batch_bytes``, ``protocol``, and the system's own ``options``.
    """

    name: str
    description: str
    unavailable: Callable[[], str | None]
    target: Callable[[Connection, dict[str, Any]], None]
    initiator: Callable[[Connection, dict[str, Any], Any], None]
    options: Mapping[str, Any] = field(default_factory=dict)


def _pattern(n: int) -> bytes:
    return bytes((i * 7 + 3) % 251 for i in range(251)) * (n // 251 + 1)


# ---- Mooncake's API (its own binding, or afabric.compat.mooncake) ----


def _mooncake_class(module: str) -> Any:
    return importlib.import_module(module).TransferEngine


def mooncake_target(conn: Connection, params: dict[str, Any]) -> None:
    """A target of Mooncake's API: a managed buffer the size of one batch."""
    te = _mooncake_class(params["module"])()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", params["protocol"], "") != 0:
        raise RuntimeError(f"{params['module']}: initialize failed")
    addr = te.allocate_managed_buffer(params["batch_bytes"])
    if not addr:
        raise RuntimeError(f"{params['module']}: allocate_managed_buffer failed")
    conn.send((f"127.0.0.1:{te.get_rpc_port()}", addr))
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if isinstance(msg, tuple) and msg[0] == "sha":
            conn.send(("sha", hashlib.sha256(raw.bytes_at(addr, msg[1])).hexdigest()))


def mooncake_initiator(conn: Connection, params: dict[str, Any], target: Any) -> None:
    """Times ``batch_transfer_sync_write`` of each size's batches to the target."""
    name, dst = target
    te = _mooncake_class(params["module"])()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", params["protocol"], "") != 0:
        raise RuntimeError(f"{params['module']}: initialize failed")
    total = params["batch_bytes"]
    src = te.allocate_managed_buffer(total)
    if not src:
        raise RuntimeError(f"{params['module']}: allocate_managed_buffer failed")
    data = _pattern(total)[:total]
    raw.copy_to_address(src, data, total)
    times: dict[int, list[float]] = {}
    for size in params["sizes"]:
        n = max(1, total // size)
        srcs = [src + i * size for i in range(n)]
        dsts = [dst + i * size for i in range(n)]
        lens = [size] * n
        runs = []
        for i in range(WARMUP + params["iterations"]):
            t0 = time.perf_counter()
            rc = te.batch_transfer_sync_write(name, srcs, dsts, lens)
            took = time.perf_counter() - t0
            if rc != 0:
                raise RuntimeError(f"{params['module']}: batch_transfer_sync_write of {n} x {size} B: {rc}")
            if i >= WARMUP:
                runs.append(took)
        times[size] = runs
    conn.send(times)
    conn.send(hashlib.sha256(data[: checked_bytes(params)]).hexdigest())


def checked_bytes(params: dict[str, Any]) -> int:
    """How many bytes at the start of the target's buffer every size's batches wrote."""
    return min(max(1, int(params["batch_bytes"]) // int(s)) * int(s) for s in params["sizes"])


def _real_mooncake_missing() -> str | None:
    """Why Mooncake's own binding cannot run here, or None. Asked in a child process: its
    import loads Mooncake's native library, and here the name may be afabric's alias."""
    code = "import mooncake.engine as m; print(m.TransferEngine.__module__)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "importing mooncake.engine did not finish in 120 s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"Mooncake is not installed (pip install mooncake-transfer-engine-non-cuda): {last}"
    if out.stdout.strip().startswith("afabric"):
        return "the installed `mooncake` is afabric's alias (compat/mooncake), not Mooncake"
    return None


def _ours_missing() -> str | None:
    return None


SYSTEMS: dict[str, System] = {
    "mooncake": System(
        "mooncake", "Mooncake's TransferEngine (mooncake.engine)", _real_mooncake_missing,
        mooncake_target, mooncake_initiator, {"module": "mooncake.engine"},
    ),
    "afabric-mooncake": System(
        "afabric-mooncake", "afabric.compat.mooncake.TransferEngine", _ours_missing,
        mooncake_target, mooncake_initiator, {"module": "afabric.compat.mooncake"},
    ),
    "nixl": System(
        "nixl", "NIXL's nixl_agent (nixl._api, UCX)", compat_nixl.real_nixl_missing,
        compat_nixl.nixl_target, compat_nixl.nixl_initiator, {"module": "nixl._api", "vllm": True},
    ),
    "afabric-nixl": System(
        "afabric-nixl", "afabric.compat.nixl's nixl_agent", _ours_missing,
        compat_nixl.nixl_target, compat_nixl.nixl_initiator,
        {"module": "afabric.compat.nixl._api", "vllm": True},
    ),
}  # fmt: skip
"""Every column, in order (``--systems`` picks some). Each carries its own params:
``module`` names the Python module of the API it drives; ``vllm`` (NIXL's columns) also
times vLLM's READ of many block descriptors."""


# ---- the command ----


def add_arguments(p: argparse.ArgumentParser) -> None:  # fmt: skip
    p.add_argument("--systems", default=",".join(SYSTEMS), metavar="LIST",
                   help=f"comma-separated columns (default: {','.join(SYSTEMS)})")
    p.add_argument("--sizes", type=harness.size_list, default=None, metavar="LIST",
                   help="bytes per write (default: 64K,1M,16M)")
    p.add_argument("--batch-bytes", type=harness.parse_size, default=None, metavar="BYTES",
                   help="bytes per batch (default: 64M): a batch is batch_bytes // size writes")
    p.add_argument("--iterations", type=int, default=None, metavar="N",
                   help=f"timed batches per size (default: {ITERATIONS})")
    p.add_argument("--protocol", default="tcp",
                   help="the framework protocol name every column uses (default: tcp); "
                        "AFABRIC_COMPAT_PROVIDER picks afabric's provider instead")
    p.add_argument("--json", metavar="PATH", default=None, help=harness.JSON_HELP)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ITERATIONS} batches per size (smoke run)")


def _run_system(system: System, params: dict[str, Any]) -> dict[str, Any]:
    target = harness.Child(f"{system.name} target", system.target, (harness.PIPE, params))
    try:
        info = target.recv(120)
        init = harness.Child(f"{system.name} initiator", system.initiator, (harness.PIPE, params, info))
        try:
            times = init.recv(600)
            sha = init.recv(60)
        finally:
            init.close()
        target.send(("sha", checked_bytes(params)))
        got = target.recv(60)
        target.stop()
    finally:
        target.close()
    vllm = times.pop("vllm_read", None)
    out: dict[str, Any] = {"checked": got == ("sha", sha), "sizes": {}}
    if vllm is not None:
        out["vllm_read"] = vllm
        out["checked"] = out["checked"] and vllm["checked"]
    for size, runs in times.items():
        median = statistics.median(runs)
        n = max(1, params["batch_bytes"] // size)
        out["sizes"][str(size)] = {
            "writes_per_batch": n,
            "batch_s_median": median,
            "gbps_median": n * size / median / 1e9,
            "batch_s": runs,
        }
    return out


def _label(size: int) -> str:
    return f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB" if size >= 1 << 10 else f"{size} B"


def main(args: argparse.Namespace) -> int:
    listed = str(getattr(args, "systems", "") or ",".join(SYSTEMS))
    names = [s.strip() for s in listed.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown:
        raise harness.CommandError(f"unknown system(s) {', '.join(unknown)}; known: {', '.join(SYSTEMS)}")
    sizes = list(getattr(args, "sizes", None) or SIZES)
    iterations = getattr(args, "iterations", None)
    iterations = max(1, int(iterations)) if iterations else (QUICK_ITERATIONS if args.quick else ITERATIONS)
    batch_bytes = int(getattr(args, "batch_bytes", None) or BATCH_BYTES)
    if batch_bytes < max(sizes):
        raise harness.CommandError(f"--batch-bytes {batch_bytes} is below the largest size {max(sizes)}")
    protocol = str(getattr(args, "protocol", None) or "tcp")
    results: dict[str, Any] = {}
    for name in names:
        system = SYSTEMS[name]
        why = system.unavailable()
        if why is not None:
            results[name] = {"skipped": why}
            print(f"{name}: skipped: {why}", file=sys.stderr)
            continue
        params = {
            "sizes": sizes, "iterations": iterations, "batch_bytes": batch_bytes, "protocol": protocol,
            "vllm": False, "quick": bool(args.quick), **system.options,
        }  # fmt: skip
        print(f"{name}: {system.description} ...", file=sys.stderr)
        results[name] = _run_system(system, params)
    override = os.environ.get("AFABRIC_COMPAT_PROVIDER")
    header = (
        f"afabric bench compat — protocol {protocol}"
        + (f" (AFABRIC_COMPAT_PROVIDER={override})" if override else "")
        + f", {os.cpu_count()} cores, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        f"batch_transfer_sync_write (NIXL: a prepared transfer) of {_label(batch_bytes)} batches, "
        f"{iterations} timed per size; GB/s of the median batch (median batch time)"
    )
    print(header)
    print(f"{'size':>8} " + " ".join(f"{n:>24}" for n in names))
    for size in sizes:
        cells = []
        for n in names:
            r = results[n]
            if "skipped" in r:
                cells.append(f"{'skipped':>24}")
            else:
                s = r["sizes"][str(size)]
                cells.append(f"{s['gbps_median']:>9.2f} GB/s ({s['batch_s_median'] * 1e3:7.1f} ms)")
        print(f"{_label(size):>8} " + " ".join(cells))
    reads = {n: results[n]["vllm_read"] for n in names if "vllm_read" in results[n]}
    if reads:
        first = next(iter(reads.values()))
        cells = [
            f"{r['gbps_median']:>9.2f} GB/s ({r['read_s_median'] * 1e3:7.1f} ms)"
            if (r := reads.get(n))
            else f"{'skipped' if 'skipped' in results[n] else '-':>24}"
            for n in names
        ]
        print(f"{'vLLM READ':>8} " + " ".join(cells))
        layout = "64 layers x (K, V) x 100 blocks"
        print(f"vLLM READ: {first['descriptors']} descriptors of {_label(first['block_bytes'])} ({layout})")
    for n in names:
        r = results[n]
        print(f"{n}: " + (f"skipped: {r['skipped']}" if "skipped" in r else f"data checked: {r['checked']}"))
    harness.write_json({"command": "afabric bench compat", "header": header, "results": results}, args)
    return 0 if all(r.get("checked", True) for r in results.values()) else 1
