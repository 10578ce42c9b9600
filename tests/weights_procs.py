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


async def member(
    ctl: Ctl, provider: str, rank: int, world: int, port: int, cfg: dict[str, Any]
) -> dict[str, Any]:
    """One rank. cfg: trainers, model kwargs, tp, fp8, mesh (None or HSDP shard group),
    steps, options, die_at (a trainer rank that kills itself half way through its writes of
    step die_step), rank0 (even steps use the rank-0 baseline)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from afabric import weights as W
    from afabric.weights.quant import dequantize_blocks

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=timedelta(seconds=cfg.get("pg_timeout", 30)),
    )  # fmt: skip
    trainers = list(range(cfg["trainers"]))
    inference = list(range(cfg["trainers"], world))
    model = W.small_model(**cfg["model"])
    group = cfg.get("shard_group") or len(trainers)
    if group == len(trainers):
        mesh = DeviceMesh("cpu", trainers)
        placements: list[Any] = [Shard(0)]
    else:
        mesh = DeviceMesh("cpu", [trainers[i : i + group] for i in range(0, len(trainers), group)])
        placements = [Replicate(), Shard(0)]
    params = None
    tensors = None
    shapes = {n: (s, d) for n, s, d in W.training_params(model)}

    def make(step: int) -> dict[str, Any]:
        out = {}
        for name, (shape, dt) in shapes.items():
            full = weight(name, shape, dt, step)
            meta = W.SourceParam(name, shape, dt, tuple(mesh.mesh.shape), tuple(mesh.mesh.flatten().tolist()),
                                 tuple(W.Placement(0) if isinstance(p, Shard) else W.Placement() for p in placements))
            box = meta.box_of(rank)
            local = full[tuple(slice(a, b) for a, b in box)].clone()
            out[name] = DTensor.from_local(local, mesh, placements, run_check=False,
                                           shape=full.shape, stride=full.stride())
        return out

    if rank in trainers:
        params = make(1)
    else:
        tp = cfg["tp"]
        tensors = W.rank_tensors(model, tp, (rank - len(trainers)) % tp, cfg["fp8"])
    result: dict[str, Any] = {"rank": rank, "steps": []}
    async with afabric.Engine(provider) as eng:
        wt = await W.WeightTransfer.connect(
            eng, trainers=trainers, inference=inference, params=params, tensors=tensors,
            options=W.PlanOptions(**cfg.get("options", {})), staging_bytes=cfg.get("staging", 1 << 20),
            timeout=cfg.get("timeout", 30),
        )  # fmt: skip
        result["unshard"] = sum(len(g.unshard) for g in wt.plan.groups)
        result["direct_tasks"] = sum(1 for t in wt.plan.tasks if not t.unshard)
        result["fp8_tasks"] = sum(1 for t in wt.plan.tasks if t.fp8)
        try:
            for step in range(1, cfg.get("steps", 1) + 1):
                if params is not None and step > 1:
                    fresh = make(step)
                    for name, t in params.items():  # in place, as an optimizer step would
                        t.to_local().copy_(fresh[name].to_local())
                hook = None
                if rank == cfg.get("die_at") and step == cfg.get("die_step", 1):
                    def hook(done: int, total: int) -> None:
                        if done * 2 >= total:
                            os.kill(os.getpid(), signal.SIGKILL)
                t0 = time.monotonic()
                try:
                    if cfg.get("rank0") and step % 2 == 0:
                        stats = await wt.update_rank0(step)
                    else:
                        stats = await wt.update(step, on_progress=hook)
                except W.WeightUpdateFailed as e:
                    result["failed"] = {"step": step, "after": time.monotonic() - t0, "error": str(e)}
                    if wt.receiver is not None:
                        result["version"] = wt.receiver.version()
                        result["words"] = wt.receiver.words()
                    return result
                info: dict[str, Any] = {"bytes_sent": stats.bytes_sent, "bytes_received": stats.bytes_received}
                if wt.receiver is not None:
                    assert tensors is not None
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
                                f"{t.name} {tuple(got.shape)} differs in rows {bad[:3].tolist()}..{bad[-3:].tolist()}"
                                f" (of {bad.numel()}); step {step}; got {got.flatten()[:4].tolist()} want {want.flatten()[:4].tolist()}")
                    ref = W.simulate(wt.plan, full)[inference.index(rank)]
                    hdr = wt.plan.header_bytes
                    assert torch.equal(wt.receiver.buffer[hdr:], ref[hdr:]), "buffer differs from the plan's"
                    info["version"] = wt.receiver.version()
                    info["fp8_worst"] = worst
                result["steps"].append(info)
                await wt.barrier()  # inference has read this version: the next may overwrite it
        finally:
            wt.close()
    dist.destroy_process_group()
    return result
