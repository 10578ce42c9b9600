"""Trainer and inference processes for the weight transfer tests: each joins one gloo
process group, opens an engine and a :class:`afabric.weights.WeightTransfer` session.
Weights are a deterministic function of (name, step), so inference ranks can compute
what they should have received."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from datetime import timedelta
from typing import Any

import afabric

from .procs import Ctl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def weight(name: str, shape: tuple[int, ...], dtype: str, step: int) -> Any:
    import torch

    seed = int.from_bytes(hashlib.sha256(f"{name}/{step}".encode()).digest()[:6], "little")
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 0.05).to(getattr(torch, dtype))


def expected(t: Any, full: dict[str, Any]) -> Any:
    """A destination tensor built straight from whole weights (independent of the plan)."""
    import torch

    return torch.cat([full[p.source][tuple(slice(a, b) for a, b in p.box)] for p in t.parts], dim=0)


def _mesh(cfg: dict[str, Any], trainers: list[int]) -> tuple[Any, list[Any]]:
    """FSDP over every trainer, or HSDP (Replicate, Shard(0)) with cfg["shard_group"]."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    group = cfg.get("shard_group") or len(trainers)
    if group == len(trainers):
        return DeviceMesh("cpu", trainers), [Shard(0)]
    rows = [trainers[i : i + group] for i in range(0, len(trainers), group)]
    return DeviceMesh("cpu", rows), [Replicate(), Shard(0)]


def _shards(rank: int, mesh: Any, placements: list[Any], shapes: dict[str, Any], step: int) -> dict[str, Any]:
    """This trainer's DTensor shards of every weight at ``step``."""
    from torch.distributed.tensor import DTensor, Shard

    from afabric import weights as aw

    out = {}
    pl = tuple(aw.Placement(0) if isinstance(p, Shard) else aw.Placement() for p in placements)
    for name, (shape, dt) in shapes.items():
        full = weight(name, shape, dt, step)
        meta = aw.SourceParam(
            name, shape, dt, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()), pl
        )
        local = full[tuple(slice(a, b) for a, b in meta.box_of(rank))].clone()
        out[name] = DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape,
                                       stride=full.stride())  # fmt: skip
    return out


def _check(wt: Any, tensors: list[Any], shapes: dict[str, Any], step: int) -> float:
    """Compare an inference rank's tensors with whole weights; the worst fp8 error as a
    fraction of the tolerance."""
    import torch

    from afabric import weights as aw
    from afabric.weights.quant import dequantize_blocks

    full = {n: weight(n, s, d, step) for n, (s, d) in shapes.items()}
    worst = 0.0
    for t in tensors:
        got = wt.receiver.tensors[t.name]
        want = expected(t, full)
        if t.fp8:
            deq = dequantize_blocks(got, wt.receiver.tensors[t.name + ".scale"], t.block)
            err = (deq - want.float()).abs().max().item()
            tol = want.float().abs().max().item() / 8  # e4m3: 3 mantissa bits
            assert err <= tol, f"{t.name}: fp8 error {err} over {tol}"
            worst = max(worst, err / max(tol, 1e-30))
        else:
            bad = (got != want).reshape(got.shape[0], -1).any(dim=-1).nonzero().flatten()
            assert got.dtype == want.dtype and not bad.numel(), (
                f"{t.name}: {bad.numel()} rows differ, first {bad[:3].tolist()}; step {step}"
            )
    ref = aw.simulate(wt.plan, full)[wt.plan.inference.index(wt.rank)]
    hdr = wt.plan.header_bytes
    assert torch.equal(wt.receiver.buffer[hdr:], ref[hdr:]), (
        "buffer differs from the plan run without transport"
    )
    return worst


def _suicide(done: int, total: int) -> None:
    if done * 2 >= total:
        os.kill(os.getpid(), signal.SIGKILL)


async def member(
    ctl: Ctl, provider: str, rank: int, world: int, port: int, cfg: dict[str, Any]
) -> dict[str, Any]:
    """One rank. cfg: trainers, model kwargs, tp, fp8, shard_group (HSDP), steps, options,
    die_at (a trainer rank that kills itself half way through its writes of step die_step),
    rank0 (even steps use the rank-0 baseline), hosts (per rank: the address its engine
    binds and gloo's interface, on a two-host bed; rank 0's address is gloo's rendezvous)."""
    import torch.distributed as dist

    from afabric import weights as aw

    bind, master = None, "127.0.0.1"
    if "hosts" in cfg:
        bind, os.environ["GLOO_SOCKET_IFNAME"] = cfg["hosts"][rank]
        master = cfg["hosts"][0][0]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=cfg.get("pg_timeout", 30)),
    )  # fmt: skip
    trainers = list(range(cfg["trainers"]))
    model = aw.small_model(**cfg["model"])
    mesh, placements = _mesh(cfg, trainers)  # every rank takes part in creating it
    shapes = {n: (s, d) for n, s, d in aw.training_params(model)}
    params = _shards(rank, mesh, placements, shapes, 1) if rank in trainers else None
    tensors = (
        None if params else aw.rank_tensors(model, cfg["tp"], (rank - len(trainers)) % cfg["tp"], cfg["fp8"])
    )
    result: dict[str, Any] = {"rank": rank, "steps": []}
    async with afabric.Engine(provider, bind=bind) as eng:
        wt = await aw.WeightTransfer.connect(
            eng, trainers=trainers, inference=list(range(len(trainers), world)), params=params,
            tensors=tensors, options=aw.PlanOptions(**cfg.get("options", {})),
            staging_bytes=cfg.get("staging", 1 << 20), timeout=cfg.get("timeout", 30),
        )  # fmt: skip
        result["unshard"] = sum(len(g.unshard) for g in wt.plan.groups)
        result["direct_tasks"] = sum(1 for t in wt.plan.tasks if not t.unshard)
        result["fp8_tasks"] = sum(1 for t in wt.plan.tasks if t.fp8)
        try:
            for step in range(1, cfg.get("steps", 1) + 1):
                if params is not None and step > 1:
                    fresh = _shards(rank, mesh, placements, shapes, step)
                    for name, t in params.items():  # in place, as an optimizer step would
                        t.to_local().copy_(fresh[name].to_local())
                dies = rank == cfg.get("die_at") and step == cfg.get("die_step", 1)
                t0 = time.monotonic()
                try:
                    if cfg.get("rank0") and step % 2 == 0:
                        stats = await wt.update_rank0(step)
                    else:
                        stats = await wt.update(step, on_progress=_suicide if dies else None)
                except aw.WeightUpdateFailed as e:
                    result["failed"] = {"step": step, "after": time.monotonic() - t0, "error": str(e)}
                    if wt.receiver is not None:
                        result["version"] = wt.receiver.version()
                        result["words"] = wt.receiver.words()
                    return result
                info: dict[str, Any] = {
                    "bytes_sent": stats.bytes_sent,
                    "bytes_received": stats.bytes_received,
                }
                if tensors is not None:
                    info["fp8_worst"] = _check(wt, tensors, shapes, step)
                    info["version"] = wt.receiver.version()
                result["steps"].append(info)
                await wt.barrier()  # inference has read this version: the next may overwrite it
            result["writes"] = {n["transport"]: n["writes"] for n in eng.stats()["nics"]}
        finally:
            wt.close()
    dist.destroy_process_group()
    return result
