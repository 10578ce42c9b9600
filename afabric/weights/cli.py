"""``afabric weights plan``: the real routing plan for a published model at a scale these
machines cannot run, with the bytes each rank moves and the projected transfer time for
point-to-point and for the rank-0 baseline at a given NIC speed."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from ..bench import harness

HELP = "RL weight transfer: plan a model's update at scale (afabric weights plan)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    count = harness.positive_int  # an argparse type: a whole number >= 1
    sub = parser.add_subparsers(dest="weights_command", metavar="COMMAND", required=True)
    p = sub.add_parser("plan", help="per-rank bytes and projected update time, P2P vs rank-0")
    p.add_argument(
        "--model",
        required=True,
        metavar="PRESET",
        help="kimi-k2, deepseek-v3 or qwen3-235b (published shapes)",
    )
    p.add_argument("--trainers", type=count, default=256, help="training ranks, one NIC each (default 256)")
    p.add_argument("--inference", type=count, default=128, help="inference ranks, one NIC each (default 128)")
    p.add_argument("--nic-gbps", type=float, default=400.0, help="NIC speed per rank in Gb/s (default 400)")
    p.add_argument(
        "--inference-tp",
        type=count,
        default=None,
        metavar="N",
        help="ranks per inference replica (default: the preset's, 16 or 8)",
    )
    p.add_argument(
        "--shard-group",
        type=count,
        default=8,
        metavar="G",
        help="training ranks sharing one shard of the non-expert weights (HSDP; default 8, a node)",
    )
    p.add_argument(
        "--expert-parallel",
        type=count,
        default=None,
        metavar="EP",
        help="training ranks the routed experts are spread over (default: gcd(trainers, experts))",
    )
    p.add_argument(
        "--nvlink-gbps",
        type=float,
        default=3600.0,
        help="intra-node speed for unsharding within a shard group (default 3600 Gb/s)",
    )
    p.add_argument("--bf16", action="store_true", help="inference keeps bf16 (default: fp8 linear layers)")
    p.add_argument("--layers", type=count, default=None, help="plan only this many layers (quick look)")
    p.add_argument(
        "--json", metavar="PATH", default=None,
        help="also write the numbers as JSON to PATH ('-': to stdout, and the report to stderr)",
    )  # fmt: skip


def project(ns: argparse.Namespace) -> dict[str, Any]:
    """Build the plan and the projection (the numbers ``main`` prints)."""
    from ..errors import InvalidArgument
    from .meta import box_numel, dtype_size
    from .models import (
        PRESETS,
        default_expert_parallel,
        inference_layouts,
        moe_sources,
        param_count,
        with_layers,
    )
    from .plan import build_plan, replica_sets

    if ns.model not in PRESETS:
        raise InvalidArgument(f"unknown model {ns.model!r}: one of {', '.join(sorted(PRESETS))}")
    m = PRESETS[ns.model]
    if ns.layers is not None:
        m = with_layers(m, ns.layers)
    if ns.trainers < 1 or ns.inference < 1 or ns.nic_gbps <= 0:
        raise InvalidArgument("trainers, inference and nic-gbps must be positive")
    tp = ns.inference_tp or m.replica
    ep = ns.expert_parallel or default_expert_parallel(m, ns.trainers)
    trainers = list(range(ns.trainers))
    inference = list(range(ns.trainers, ns.trainers + ns.inference))
    sources = moe_sources(m, trainers, min(ns.shard_group, ns.trainers), ep)
    layouts = inference_layouts(m, ns.inference, tp, ns.trainers, fp8=not ns.bf16)
    t0 = time.perf_counter()
    plan = build_plan(sources, layouts, trainers=trainers, inference=inference)
    built = time.perf_counter() - t0
    speed = ns.nic_gbps * 1e9 / 8
    sent, recv = plan.sent_bytes(), plan.received_bytes()
    busiest = max(*sent.values(), *recv.values())
    # unsharding: what each rank all-gathers within its shard group (bytes it lacks)
    unshard_in = dict.fromkeys(trainers, 0)
    for g in plan.groups:
        for name in g.unshard:
            src = plan.sources[name]
            whole = src.nbytes
            for r, box in src.holders():
                unshard_in[r] += whole - box_numel(box) * dtype_size(src.dtype)
    # rank-0: everything into trainer 0, the converted model to inference 0, scattered from there
    gather_in = 0
    for src in plan.sources.values():
        for box, ranks in replica_sets(src):
            if ranks[0] != trainers[0]:
                gather_in += box_numel(box) * dtype_size(src.dtype)
    unique = plan.unique_bytes()
    scatter_out = sum(plan.dst_sizes[1:])
    p2p_s = busiest / speed
    unshard_s = max(unshard_in.values()) / (ns.nvlink_gbps * 1e9 / 8)
    rank0_s = (gather_in + unique + scatter_out) / speed
    p2p = {
        "trainer_mean": sum(sent.values()) / len(sent),
        "trainer_max": max(sent.values()),
        "inference_max": max(recv.values()),
        "busiest_nic": busiest,
        "seconds": max(p2p_s, unshard_s),
        "nic_seconds": p2p_s,
        "unshard_per_rank": max(unshard_in.values()),
        "unshard_seconds": unshard_s,
    }
    rank0 = {
        "gather_into_trainer0": gather_in,
        "send": unique,
        "scatter_from_inference0": scatter_out,
        "busiest_nic": max(gather_in, unique, scatter_out),
        "seconds": rank0_s,
    }
    return {
        "model": m.name, "params": param_count(m), "layers": m.layers,
        "trainers": ns.trainers, "inference": ns.inference, "inference_tp": tp, "expert_parallel": ep,
        "shard_group": min(ns.shard_group, ns.trainers), "fp8": not ns.bf16, "nic_gbps": ns.nic_gbps,
        "nvlink_gbps": ns.nvlink_gbps,
        "slices": len(plan.tasks), "writes": int(plan.writes.shape[0]), "plan_seconds": built,
        "p2p": p2p, "rank0": rank0, "ratio": rank0_s / max(p2p_s, unshard_s),
    }  # fmt: skip


def _gb(n: float) -> str:
    return f"{n / 1e9:,.1f} GB"


def main(ns: argparse.Namespace) -> int:
    r = project(ns)
    p, z = r["p2p"], r["rank0"]
    dtype = "fp8 linear layers" if r["fp8"] else "bf16"
    replicas = r["inference"] // r["inference_tp"]
    print(f"model      {r['model']}: {r['params'] / 1e9:,.1f} B parameters, {r['layers']} layers; "
          f"inference {dtype}")  # fmt: skip
    print(
        f"ranks      {r['trainers']} trainers (experts over {r['expert_parallel']}, other weights sharded "
        f"over {r['shard_group']}) -> {r['inference']} inference ({replicas} replicas of {r['inference_tp']})"
    )
    print(f"plan       {r['slices']:,} slices, {r['writes']:,} writes, built in {r['plan_seconds']:.1f} s")
    print(
        f"p2p        per trainer {_gb(p['trainer_mean'])} mean, {_gb(p['trainer_max'])} max; "
        f"per inference rank {_gb(p['inference_max'])} max"
    )
    nic = f"{r['nic_gbps']:g} Gb/s"
    print(f"           busiest NIC {_gb(p['busiest_nic'])} -> {p['nic_seconds']:.2f} s at {nic}; unsharding "
          f"{_gb(p['unshard_per_rank'])} per rank within its shard group -> {p['unshard_seconds']:.3f} s at "
          f"{r['nvlink_gbps']:g} Gb/s (overlapped)")  # fmt: skip
    print(
        f"rank-0     gather {_gb(z['gather_into_trainer0'])} into trainer 0, send {_gb(z['send'])}, "
        f"scatter {_gb(z['scatter_from_inference0'])} -> {z['seconds']:.1f} s at {nic}"
    )
    print(f"projected  p2p {p['seconds']:.2f} s vs rank-0 {z['seconds']:.1f} s: {r['ratio']:.0f}x")
    sys.stdout.flush()
    if ns.json:
        from ..bench import harness

        harness.write_json(r, ns)
    return 0
