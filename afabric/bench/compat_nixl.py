"""The NIXL columns of ``afabric bench compat``: NIXL's own ``nixl_agent`` (when its wheel is
installed) and afabric.compat.nixl, driven through the same NIXL API.

Two workloads, each a process pair (target, initiator) of its own:

- the command's batch write: per size S, ``batch_bytes // S`` descriptors of S bytes
  prepared once (``prep_xfer_dlist`` on both sides, ``make_prepped_xfer``), the handle posted
  again for every batch (``transfer`` then ``check_xfer_state`` until ``DONE``);
- vLLM's disaggregated-prefill READ: 64 layers x 2 (K, V) registrations of 128 blocks on
  each side, 100 random blocks of each read in one ``make_prepped_xfer`` (12,800
  descriptors), then the blocks compared with the target's. A block is 16 KiB, or less where
  one side's registrations would exceed 4 x ``batch_bytes`` (1 KiB at most with ``--quick``).

For ``--protocol tcp`` NIXL's UCX is held to TCP (``UCX_TLS=tcp`` unless set) and afabric to
its tcp provider (unless AFABRIC_COMPAT_PROVIDER names one). Nothing here asserts speed.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

WARMUP = 1
VLLM_LAYERS = 64
VLLM_BLOCKS = 100  # blocks read per registration
VLLM_REGION_BLOCKS = 128  # blocks each registration holds
VLLM_BLOCK_BYTES = 16 << 10
VLLM_QUICK_BLOCK_BYTES = 1 << 10


def real_nixl_missing() -> str | None:
    """Why NIXL's own wheel cannot run here, or None. Asked in a child process: its import
    loads NIXL's native library, and here the name may be afabric's alias."""
    code = "import nixl._api as m; print(m.nixl_agent.__module__)"
    try:
        out = subprocess.run(
            [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120
        )
    except subprocess.TimeoutExpired:
        return "importing nixl._api did not finish in 120 s"
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        return f"NIXL is not installed (pip install nixl-cu12): {last}"
    if out.stdout.strip().startswith("afabric"):
        return "the installed `nixl` is afabric's alias (compat/nixl), not NIXL"
    return None


def _api(params: dict[str, Any]) -> Any:
    """NIXL's API module for this column, with the protocol applied to this process."""
    module = str(params["module"])
    if params.get("protocol") == "tcp":
        if module.startswith("afabric"):
            os.environ.setdefault("AFABRIC_COMPAT_PROVIDER", "tcp")
        else:
            os.environ.setdefault("UCX_TLS", "tcp")
    return importlib.import_module(module)


def _agent(api: Any, name: str) -> Any:
    return api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))


def _kv_layout(params: dict[str, Any]) -> tuple[int, int, int]:
    """(registrations, blocks each, bytes a block) of the vLLM READ."""
    regions = 2 * VLLM_LAYERS
    block = VLLM_QUICK_BLOCK_BYTES if params.get("quick") else VLLM_BLOCK_BYTES
    room = 4 * int(params["batch_bytes"]) // (regions * VLLM_REGION_BLOCKS)
    return regions, VLLM_REGION_BLOCKS, max(8, min(block, room) // 8 * 8)


def _kv_fill(region: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(region).integers(0, 256, nbytes, dtype=np.uint8)


def nixl_target(conn: Connection, params: dict[str, Any]) -> None:
    """A NIXL target: one buffer the size of a batch, and the vLLM READ's registrations
    (filled with a pattern per registration); serves ``("sha", n)`` until ``"stop"``."""
    api = _api(params)
    agent = _agent(api, "bench-target")
    buf = np.zeros(int(params["batch_bytes"]), dtype=np.uint8)
    regions, per, block = _kv_layout(params)
    kv = [_kv_fill(r, per * block) for r in range(regions)] if params.get("vllm") else []
    rows = [(int(buf.ctypes.data), buf.nbytes, 0, "")] + [(int(t.ctypes.data), t.nbytes, 0, "") for t in kv]
    agent.register_memory(rows, "DRAM")
    conn.send((agent.get_agent_metadata(), int(buf.ctypes.data), [int(t.ctypes.data) for t in kv]))
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if isinstance(msg, tuple) and msg[0] == "sha":
            conn.send(("sha", hashlib.sha256(buf[: int(msg[1])].tobytes()).hexdigest()))


def _wait_done(agent: Any, handle: Any) -> None:
    while agent.check_xfer_state(handle) != "DONE":
        pass


def _descs(base: int, count: int, size: int) -> np.ndarray:
    rows = np.zeros((count, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(count, dtype=np.uint64) * np.uint64(size)
    rows[:, 1] = size
    return rows


def nixl_initiator(conn: Connection, params: dict[str, Any], target: Any) -> None:
    """Times each size's batch write (one prepped transfer of batch_bytes // size
    descriptors, posted again per batch) and, with ``vllm``, the vLLM READ; sends the times
    (``{size: [s, ...], "vllm_read": {...}}``) then the sha256 of what it wrote."""
    md, dst, kv_remote = target
    api = _api(params)
    agent = _agent(api, "bench-initiator")
    peer = agent.add_remote_agent(md)
    peer = peer.decode() if isinstance(peer, bytes) else str(peer)
    total = int(params["batch_bytes"])
    src = np.frombuffer(bytes((i * 7 + 3) % 251 for i in range(251)) * (total // 251 + 1), np.uint8)[
        :total
    ].copy()
    agent.register_memory([(int(src.ctypes.data), total, 0, "")], "DRAM")
    times: dict[Any, Any] = {}
    for size in params["sizes"]:
        n = max(1, total // size)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", _descs(int(src.ctypes.data), n, size), "DRAM")
        remote = agent.prep_xfer_dlist(peer, _descs(dst, n, size), "DRAM")
        idx = np.arange(n, dtype=np.int32)
        handle = agent.make_prepped_xfer("WRITE", local, idx, remote, idx)
        runs = []
        for i in range(WARMUP + int(params["iterations"])):
            t0 = time.perf_counter()
            agent.transfer(handle)
            _wait_done(agent, handle)
            if i >= WARMUP:
                runs.append(time.perf_counter() - t0)
        times[size] = runs
        agent.release_xfer_handle(handle)
        agent.release_dlist_handle(local)
        agent.release_dlist_handle(remote)
    if params.get("vllm"):
        times["vllm_read"] = _vllm_read(agent, peer, kv_remote, params)
    conn.send(times)
    written = min(max(1, total // int(s)) * int(s) for s in params["sizes"])
    conn.send(hashlib.sha256(src[:written].tobytes()).hexdigest())


def _vllm_read(agent: Any, peer: str, kv_remote: list[int], params: dict[str, Any]) -> dict[str, Any]:
    regions, per, block = _kv_layout(params)
    kv = [np.zeros(per * block, np.uint8) for _ in range(regions)]
    agent.register_memory([(int(t.ctypes.data), t.nbytes, 0, "") for t in kv], "DRAM")
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", np.concatenate([_descs(int(t.ctypes.data), per, block) for t in kv]), "DRAM"
    )
    remote = agent.prep_xfer_dlist(peer, np.concatenate([_descs(a, per, block) for a in kv_remote]), "DRAM")
    rng = np.random.default_rng(11)
    src_ids = np.concatenate([r * per + rng.permutation(per)[:VLLM_BLOCKS] for r in range(regions)]).astype(
        np.int32
    )
    dst_ids = np.concatenate([r * per + rng.permutation(per)[:VLLM_BLOCKS] for r in range(regions)]).astype(
        np.int32
    )
    handle = agent.make_prepped_xfer("READ", local, dst_ids, remote, src_ids)
    runs = []
    for i in range(WARMUP + int(params["iterations"])):
        t0 = time.perf_counter()
        agent.transfer(handle)
        _wait_done(agent, handle)
        if i >= WARMUP:
            runs.append(time.perf_counter() - t0)
    fills = [_kv_fill(r, per * block) for r in range(regions)]
    checked = all(
        np.array_equal(
            kv[d // per][(d % per) * block : (d % per + 1) * block],
            fills[s // per][(s % per) * block : (s % per + 1) * block],
        )
        for s, d in zip(src_ids.tolist(), dst_ids.tolist(), strict=True)
    )
    median = sorted(runs)[len(runs) // 2]
    return {
        "descriptors": len(src_ids),
        "block_bytes": block,
        "read_s_median": median,
        "gbps_median": len(src_ids) * block / median / 1e9,
        "read_s": runs,
        "checked": checked,
    }
