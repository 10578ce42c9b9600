"""`afabric bench weights`: one RL weight update from N training processes to M inference
processes on this machine, point to point (every trainer writes its slices into the
inference ranks' registered memory) against the rank-0 baseline (gather to trainer 0,
send to inference 0, scatter) on the same processes and memory, alternating, with the
ratio. torch.distributed (gloo over loopback) is the control plane and the baseline's
transport; the engine's provider (shm or tcp) carries the point-to-point writes.

With ``--device cuda`` the trainers' shards live on the GPUs (round robin) and are
sliced, cast or quantised there (with ``--offload`` they stay in host memory, as with
FSDP's CPU offload, and each slice is copied to the GPU first), then staged through
pinned host memory, which is what
the provider can register where libfabric has no CUDA support; inference buffers are in
host memory. Nothing here asserts speed: it reports.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as connection_wait
from typing import Any

from . import harness

HELP = "RL weight update: N trainers -> M inference processes, point-to-point vs rank-0"


def add_arguments(p: argparse.ArgumentParser) -> None:
    count, count0 = harness.positive_int, harness.nonnegative_int  # argparse types: >= 1, >= 0
    p.add_argument("--trainers", type=count, default=8, help="training processes (default 8)")
    p.add_argument("--inference", type=count, default=4, help="inference processes (default 4)")
    p.add_argument(
        "--inference-tp",
        type=count,
        default=None,
        metavar="N",
        help="inference ranks per replica (default: all of them, one replica)",
    )
    p.add_argument("--provider", default="auto", type=harness.provider_name, help=harness.PROVIDER_HELP)
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the trainers' shards live and are prepared (default cpu)",
    )
    p.add_argument(
        "--shards",
        choices=("dtensor", "local"),
        default=None,
        help="trainer shards as DTensors (default on cpu) or LocalShard tensors with their metadata "
        "(always with cuda unless --offload: no unsharding then)",
    )
    p.add_argument(
        "--offload",
        action="store_true",
        help="with --device cuda: shards stay in host memory; slices are copied to the GPU",
    )
    p.add_argument("--layers", type=count, default=4, help="transformer layers (default 4)")
    p.add_argument("--hidden", type=count, default=2048, help="hidden size (default 2048)")
    p.add_argument("--experts", type=count0, default=16, help="routed experts per layer (default 16)")
    p.add_argument("--moe-intermediate", type=count, default=1024, help="expert MLP width (default 1024)")
    p.add_argument("--heads", type=count, default=16, help="attention heads of 128 (default 16)")
    p.add_argument("--kv-heads", type=count, default=4, help="key/value heads (default 4)")
    p.add_argument("--vocab", type=count, default=32000, help="vocabulary (default 32000)")
    p.add_argument(
        "--fp8", action="store_true", help="inference holds fp8 linear layers (128x128 tile scales)"
    )
    p.add_argument(
        "--staging-mib", type=count, default=64, help="each trainer's staging buffer (default 64 MiB)"
    )
    p.add_argument(
        "--repeat", type=count, default=None, help="timed updates per method (default 5, 2 with --quick)"
    )
    p.add_argument("--quick", action="store_true", help="a small model and 2 updates per method (CI-sized)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds any update may take (default 300)")
    p.add_argument("--json", metavar="PATH", default=None, help=harness.JSON_HELP)
    p.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default=harness.default_loop(), help=harness.LOOP_HELP
    )


def _model_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    if ns.quick:
        return {"layers": 2, "hidden": 512, "experts": 4, "moe_intermediate": 256, "heads": 4,
                "kv_heads": 2, "vocab": 4096}  # fmt: skip
    return {"layers": ns.layers, "hidden": ns.hidden, "experts": ns.experts,
            "moe_intermediate": ns.moe_intermediate, "heads": ns.heads, "kv_heads": ns.kv_heads,
            "vocab": ns.vocab}  # fmt: skip


def _rank(rank: int, world: int, port: int, cfg: dict[str, Any], conn: Connection) -> None:
    try:
        from .loops import run

        conn.send(("ok", run(_rank_async(rank, world, port, cfg), cfg.get("loop", "asyncio"))))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        conn.close()


def _trainer_params(rank: int, cfg: dict[str, Any]) -> dict[str, Any]:
    """This trainer's FSDP shards (random bf16): DTensors on the CPU; on CUDA, shards on
    the rank's GPU described by LocalShard (DTensor's gloo collectives cannot serve them)."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    from .. import weights as aw

    trainers = list(range(cfg["trainers"]))
    on_gpu = cfg["device"] == "cuda" and not cfg["offload"]
    dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if on_gpu else torch.device("cpu")
    mesh = None if cfg["shards"] == "local" else DeviceMesh("cpu", trainers)
    g = torch.Generator(device=dev).manual_seed(1234 + rank)
    params: dict[str, Any] = {}
    for meta in aw.fsdp_sources(aw.small_model(**cfg["model"]), trainers):
        shape = tuple(b - a for a, b in meta.box_of(rank))
        local = (torch.randn(shape, generator=g, device=dev) * 0.02).to(getattr(torch, meta.dtype))
        if mesh is None:
            params[meta.name] = aw.LocalShard(local, meta)
        else:
            stride = torch.empty(meta.shape, device="meta").stride()
            params[meta.name] = DTensor.from_local(
                local, mesh, [Shard(0)], run_check=False, shape=torch.Size(meta.shape), stride=stride
            )
    return params


async def _rank_async(rank: int, world: int, port: int, cfg: dict[str, Any]) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from .. import Engine
    from .. import weights as aw

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=cfg["timeout"]))  # fmt: skip
    n = cfg["trainers"]
    trainers, inference = list(range(n)), list(range(n, world))
    cuda = cfg["device"] == "cuda"
    local = cfg["shards"] == "local"
    params, tensors = None, None
    if rank in trainers:
        params = _trainer_params(rank, cfg)
    else:
        if not local:
            DeviceMesh("cpu", trainers)  # every rank takes part in creating the trainers' mesh
        tensors = aw.rank_tensors(
            aw.small_model(**cfg["model"]), cfg["tp"], (rank - n) % cfg["tp"], cfg["fp8"]
        )
    out: dict[str, Any] = {"p2p": [], "rank0": []}
    async with Engine(cfg["provider"]) as eng:
        wt = await aw.WeightTransfer.connect(
            eng, trainers=trainers, inference=inference, params=params, tensors=tensors,
            options=aw.PlanOptions(unshard="never" if local else "auto"), staging_bytes=cfg["staging"],
            device=f"cuda:{rank % torch.cuda.device_count()}" if cuda and params else None,
            timeout=cfg["timeout"], progress=False,
        )  # fmt: skip
        try:
            for k in range(cfg["repeat"] + 1):  # the first of each is a warm-up
                p = await wt.update(2 * k + 1)
                r = await wt.update_rank0(2 * k + 2)
                if k:
                    out["p2p"].append(p.seconds)
                    out["rank0"].append(r.seconds)
            if rank == 0:
                out.update(
                    plan=wt.plan.summary(), sent=wt.plan.sent_bytes(), received=wt.plan.received_bytes(),
                    payload=sum(lay.payload_bytes() for lay in wt.layouts),
                    params=aw.models.param_count(aw.small_model(**cfg["model"])),
                    unshard_params=sum(len(gr.unshard) for gr in wt.plan.groups),
                )  # fmt: skip
        finally:
            wt.close()
    dist.destroy_process_group()
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB" if n < 1e10 else f"{n / 1e9:.1f} GB"


def _collect(children: list[harness.Child], results: list[Any], deadline: float) -> str | None:
    """Each rank's result into ``results`` as it comes; why the run failed, or None."""
    pending = dict(enumerate(children))
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            return f"rank {min(pending)} did not finish in time"
        handles: list[Any] = [c.conn for c in pending.values()] + [c.sentinel for c in pending.values()]
        ready = set(connection_wait(handles, left))
        for r, c in sorted(pending.items()):
            if c.conn in ready:
                try:
                    kind, val = c.conn.recv()
                except EOFError:
                    return c.failure()
                if kind == "error":
                    return str(val)
                results[r] = val
                c.stopping = True
                del pending[r]
            elif c.sentinel in ready:
                return c.failure()
    return None


def _run(world: int, cfg: dict[str, Any], wait: float) -> tuple[list[Any], str | None]:
    """Start every rank, wait for all; ``(results, None)`` or ``(partial, why it failed)``.
    A rank that dies without reporting fails the run at once (not when its turn comes)."""
    port = _free_port()
    children: list[harness.Child] = []
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # a dozen processes on a few cores: no thread pool in each
    try:
        for r in range(world):
            children.append(harness.Child(f"rank {r}", _rank, (r, world, port, cfg, harness.PIPE)))
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    results: list[Any] = [None] * world
    failed = None
    try:
        failed = _collect(children, results, time.monotonic() + wait)
    finally:
        for c in children:
            if failed is not None and c.proc.is_alive():
                c.proc.kill()
            c.close(10)
    return results, failed


def main(ns: argparse.Namespace) -> int:
    if ns.trainers < 1 or ns.inference < 1:
        raise harness.CommandError("--trainers and --inference must be at least 1")
    tp = ns.inference_tp or ns.inference
    if ns.inference % tp:
        raise harness.CommandError(f"--inference-tp {tp} does not divide {ns.inference} inference processes")
    repeat = max(1, ns.repeat if ns.repeat is not None else (2 if ns.quick else 5))
    on_gpu = ns.device == "cuda" and not ns.offload
    shards = "local" if on_gpu else (ns.shards or "dtensor")
    if on_gpu and ns.shards == "dtensor":
        raise harness.CommandError(
            "shards on the GPU are --shards local (DTensor's gloo collectives are host-only)"
        )
    if ns.offload and ns.device != "cuda":
        raise harness.CommandError("--offload goes with --device cuda")
    harness.require("afabric bench weights", "torch")  # every rank needs it: say so now
    harness.check_outputs(ns)
    ns.provider, why = harness.resolve_provider(ns.provider)
    print(why, flush=True)
    cfg = {"trainers": ns.trainers, "model": _model_kwargs(ns), "tp": tp, "fp8": ns.fp8, "device": ns.device,
           "provider": ns.provider, "staging": ns.staging_mib << 20, "repeat": repeat, "shards": shards,
           "offload": ns.offload, "loop": getattr(ns, "loop", None) or harness.default_loop(),
           "timeout": ns.timeout}  # fmt: skip
    results, failed = _run(ns.trainers + ns.inference, cfg, ns.timeout * (2 * repeat + 4) + 120)
    if failed is not None:
        raise harness.ChildFailed(failed)
    res = results[0]
    _report(ns, cfg, res)
    if ns.json:
        med_p, med_r = statistics.median(res["p2p"]), statistics.median(res["rank0"])
        harness.write_json({"bench": "weights", "argv": getattr(ns, "argv", []), "config": cfg,
                            "p2p_seconds": res["p2p"], "rank0_seconds": res["rank0"], "ratio": med_r / med_p,
                            "sent": res["sent"], "received": res["received"], "plan": res["plan"],
                            "payload_bytes": res["payload"], "params": res["params"]}, ns)  # fmt: skip
    return 0


def _report(ns: argparse.Namespace, cfg: dict[str, Any], res: dict[str, Any]) -> None:
    p2p, r0 = res["p2p"], res["rank0"]
    sent, recv = list(res["sent"].values()), list(res["received"].values())
    summary = res["plan"]
    tp = cfg["tp"]
    where = ns.device + (" (offload)" if ns.offload else "")
    print(f"afabric bench weights: {ns.trainers} trainers -> {ns.inference} inference ({ns.inference // tp} "
          f"replica(s) of TP {tp}); provider {ns.provider}; loop {cfg['loop']}; device {where}; "
          f"{cfg['shards']} shards; "
          f"{'fp8' if ns.fp8 else 'bf16'} inference weights")  # fmt: skip
    print(f"model: {res['params'] / 1e6:.1f} M parameters, {cfg['model']}; plan: {summary['tasks']} slices, "
          f"{summary['writes']} writes, {res['unshard_params']} parameters unsharded")  # fmt: skip
    print(f"p2p bytes per update: {_gb(sum(sent))} in all; per trainer {_gb(statistics.mean(sent))} mean, "
          f"{_gb(max(sent))} max; per inference rank {_gb(max(recv))} max")  # fmt: skip
    print(f"rank-0 bytes per update: all through trainer 0 and inference 0 ({_gb(summary['unique_bytes'])} "
          f"converted once, {_gb(res['payload'])} scattered in all)")  # fmt: skip
    print(f"{'method':<8} {'median s':>9} {'min s':>9} {'max s':>9} {'GB/s':>8}")
    for name, xs in (("p2p", p2p), ("rank-0", r0)):
        med = statistics.median(xs)
        print(f"{name:<8} {med:9.3f} {min(xs):9.3f} {max(xs):9.3f} {res['payload'] / med / 1e9:8.2f}")
    ratio = statistics.median(r0) / statistics.median(p2p)
    print(f"ratio    rank-0 / p2p = {ratio:.2f}x  ({len(p2p)} timed updates each, after a warm-up)")
