"""`afabric bench moe`: MoE dispatch and combine latency, afabric vs NCCL all_to_all_single.

One process per GPU (ranks = processes). Two workloads of the issue: decode (128 tokens
per rank) and prefill (4096), hidden 7168 in fp8 with 56 fp32 scales per token, 256
experts, top-8, bf16 expert outputs; routing is top-8 of uniform random scores.

Each call is timed with CUDA events recorded on the stream right before and right after
it, as a user's program sees it (host launch overhead included, never kernel time only):
dispatch from the first to the second event, combine from the second to the third.
After warm-up, p50/p99 over ``--iters`` calls. The baseline runs the same workload in the
same processes through ``torch.distributed`` NCCL the generic way: send per-expert counts
with ``all_to_all_single``, read the split sizes on the host, send the tokens (and scales),
permute to expert-major; combine sends the expert outputs back with the same splits and
sums them with the routing weights (``index_add_``). The report gives each rank's worst
(max over ranks) percentiles and the ratio NCCL/afabric at p50. Nothing here asserts speed.

On the NVLink path the same calls are also captured into CUDA graphs (one for dispatch,
one for combine, as a decode loop under ``torch.cuda.graph`` would) and timed the same way
around each replay ("afabric+graph"). Each rank also prints the host time of its calls
(``perf_counter`` around the Python call) and, for 1,000 calls queued without events, how
long the host took to enqueue them against how long the GPUs took to run them: if the two
agree, the host sets the pace.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import queue
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from . import harness

HELP = "MoE dispatch/combine latency: afabric.moe.AllToAll vs NCCL all_to_all_single"
WORKLOADS = {"decode": 128, "prefill": 4096}
HIDDEN, EXPERTS, TOP_K, SCALE_BLOCK = 7168, 256, 8, 128
GOALS_US = {("decode", "dispatch"): 40.0, ("decode", "combine"): 45.0,
            ("prefill", "dispatch"): 250.0, ("prefill", "combine"): 380.0}  # fmt: skip
CHUNK = 1000  # calls between host syncs (events are read back per chunk)
_NO_MULTICAST = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    count, count0 = harness.positive_int, harness.nonnegative_int  # argparse types: >= 1, >= 0
    p.add_argument(
        "--path",
        choices=("nvlink", "proxy"),
        default="nvlink",
        help="NVLink (CUDA IPC) between the GPUs, or every GPU its own node behind the host proxy",
    )
    p.add_argument("--workload", choices=("decode", "prefill", "both"), default="both")
    p.add_argument("--iters", type=count, default=10_000, help="timed calls per workload and implementation")
    p.add_argument("--warmup", type=count0, default=300)
    p.add_argument("--world", type=count0, default=0, help="ranks (GPUs); 0: every GPU")
    p.add_argument(
        "--provider", default="auto", type=harness.provider_name,
        help="engine provider of the proxy path; " + harness.PROVIDER_HELP,
    )
    p.add_argument("--no-baseline", action="store_true", help="skip the NCCL baseline")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph runs (NVLink path)")
    p.add_argument("--baseline-iters", type=count0, default=0, help="timed NCCL calls (0: as --iters)")
    p.add_argument("--json", metavar="PATH", help=harness.JSON_HELP)
    p.add_argument("--quick", action="store_true", help="1,000 calls (a smoke run, not a measurement)")


@dataclass
class Stat:
    workload: str
    impl: str
    op: str
    samples: int
    p50_us: float
    p99_us: float
    mean_us: float
    max_us: float
    host_p50_us: float  # the Python call itself on the host


def _stats(workload: str, impl: str, op: str, us: Any, host_us: Any) -> Stat:
    return Stat(workload, impl, op, int(us.size), float(np.percentile(us, 50)), float(np.percentile(us, 99)),
                float(us.mean()), float(us.max()), float(np.percentile(host_us, 50)))  # fmt: skip


# ---------------------------------------------------------------- NCCL baseline


class NcclAllToAll:
    """The generic dispatch/combine over ``all_to_all_single`` (counts first, then tokens)."""

    def __init__(self, world: int, rank: int, experts: int, dev: Any) -> None:
        self.world, self.rank, self.experts, self.dev = world, rank, experts, dev
        self.e_local = experts // world

    def dispatch(self, x: Any, scales: Any, idx: Any) -> tuple[Any, Any, Any]:
        import torch
        import torch.distributed as dist

        k = idx.shape[1]
        flat = idx.reshape(-1).long()
        order = torch.argsort(flat, stable=True)
        send_e = torch.bincount(flat, minlength=self.experts).int()
        recv_e = torch.empty_like(send_e)
        dist.all_to_all_single(recv_e, send_e)
        splits = torch.stack(
            [send_e.view(self.world, -1).sum(1), recv_e.view(self.world, -1).sum(1)]
        ).tolist()
        send_splits, recv_splits = splits[0], splits[1]
        tok = order // k
        xs = x.view(torch.uint8)[tok]
        ss = scales[tok]
        total = sum(recv_splits)
        xr = torch.empty((total, x.shape[1]), dtype=torch.uint8, device=self.dev)
        sr = torch.empty((total, scales.shape[1]), dtype=torch.float32, device=self.dev)
        dist.all_to_all_single(xr, xs, recv_splits, send_splits)
        dist.all_to_all_single(sr, ss, recv_splits, send_splits)
        e_of_row = torch.repeat_interleave(
            torch.arange(self.e_local, device=self.dev).repeat(self.world), recv_e.long()
        )
        em = torch.argsort(e_of_row, stable=True)
        self.state = (order, tok, send_splits, recv_splits, em)
        return xr[em].view(torch.float8_e4m3fn), sr[em], recv_e.view(self.world, -1).sum(0)

    def combine(self, expert_out: Any, weights: Any, n_tok: int) -> Any:
        import torch
        import torch.distributed as dist

        order, tok, send_splits, recv_splits, em = self.state
        total = sum(recv_splits)
        y = torch.empty((total, expert_out.shape[1]), dtype=expert_out.dtype, device=self.dev)
        y[em] = expert_out[:total]
        back = torch.empty((tok.numel(), expert_out.shape[1]), dtype=expert_out.dtype, device=self.dev)
        dist.all_to_all_single(back, y, send_splits, recv_splits)
        # back in (token, k) order, then one batched GEMV: out[t] = sum_k w[t, k] * row[t, k]
        rows = torch.empty_like(back)
        rows[order] = back
        k = weights.shape[1]
        w = weights.to(expert_out.dtype).unsqueeze(1)
        return torch.bmm(w, rows.view(n_tok, k, -1)).squeeze(1)


# ---------------------------------------------------------------- one rank


def _inputs(tokens: int, rank: int, dev: Any) -> tuple[Any, Any, Any, Any]:
    import torch

    g = torch.Generator(device="cpu").manual_seed(1234 + rank)
    x = torch.randn(tokens, HIDDEN, generator=g).clamp(-8, 8).to(torch.float8_e4m3fn).to(dev)
    scales = (torch.rand(tokens, HIDDEN // SCALE_BLOCK, generator=g) + 0.5).to(dev)
    idx = torch.rand(tokens, EXPERTS, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32).to(dev)
    w = torch.rand(tokens, TOP_K, generator=g).to(dev)
    return x, scales, idx, w


Timings = tuple[Any, Any, Any, Any]  # µs: dispatch, combine (events); the same on the host


def _timed(step_d: Any, step_c: Any, iters: int, warmup: int) -> Timings:
    """Per-call µs of dispatch and combine, CUDA events around each call, and the host
    time of each Python call."""
    import torch

    for _ in range(warmup):
        step_d()
        step_c()
    torch.cuda.synchronize()
    d_us: list[float] = []
    c_us: list[float] = []
    hd = np.zeros(iters)
    hc = np.zeros(iters)
    clock = time.perf_counter
    done = 0
    while done < iters:
        n = min(CHUNK, iters - done)
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(n)]  # type: ignore[no-untyped-call]
        for i in range(n):
            ev[i][0].record()
            t0 = clock()
            step_d()
            t1 = clock()
            ev[i][1].record()
            t2 = clock()
            step_c()
            t3 = clock()
            ev[i][2].record()
            hd[done + i] = t1 - t0
            hc[done + i] = t3 - t2
        torch.cuda.synchronize()
        for e0, e1, e2 in ev:
            d_us.append(e0.elapsed_time(e1) * 1e3)
            c_us.append(e1.elapsed_time(e2) * 1e3)
        done += n
    return np.array(d_us), np.array(c_us), hd * 1e6, hc * 1e6


def _pace(step_d: Any, step_c: Any, calls: int = 1000) -> tuple[float, float]:
    """µs per (dispatch, combine) pair: to enqueue ``calls`` pairs, and to run them."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step_d()
        step_c()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) * 1e6 / calls, (t2 - t0) * 1e6 / calls


def _capture(a2a: Any, x: Any, idx: Any, w: Any, scales: Any, expert_out: Any) -> tuple[Any, Any]:
    """One CUDA graph holding a dispatch, one holding a combine."""
    import torch

    gd, gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(gd):
        a2a.dispatch(x, idx, w, scales)
    with torch.cuda.graph(gc):
        a2a.combine(expert_out)
    return gd, gc


def _rank(rank: int, world: int, port: int, ns_dict: dict[str, Any], results: Any) -> None:
    for k, v in _NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    import torch
    import torch.distributed as dist

    from ..moe import torch_all_gather

    ns = argparse.Namespace(**ns_dict)
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)  # fmt: skip
    gloo = dist.new_group(backend="gloo")
    gather = torch_all_gather(gloo)
    out: list[dict[str, Any]] = []
    try:
        for workload, tokens in WORKLOADS.items():
            if ns.workload in ("both", workload):
                out += _workload(workload, tokens, ns, rank, world, gather, dev)
            gather(b"next")
        results.put((rank, out, None))
    except BaseException as e:
        results.put((rank, out, f"{type(e).__name__}: {e}"))
        raise
    finally:
        dist.destroy_process_group()


def _workload(
    workload: str, tokens: int, ns: argparse.Namespace, rank: int, world: int, gather: Any, dev: Any
) -> list[dict[str, Any]]:
    import torch

    from ..moe import AllToAll, MoeConfig

    cfg = MoeConfig(
        max_tokens=tokens, num_experts=EXPERTS, experts_per_token=TOP_K, hidden=HIDDEN,
        world_size=world, in_dtype="fp8", out_dtype="bf16", scale_block=SCALE_BLOCK,
    )  # fmt: skip
    x, scales, idx, w = _inputs(tokens, rank, dev)
    out: list[dict[str, Any]] = []
    runs: list[tuple[str, Timings, tuple[float, float]]] = []
    a2a = AllToAll(cfg, rank=rank, all_gather=gather, device=rank, path=ns.path, provider=ns.provider)
    try:
        expert_out = torch.zeros((cfg.expert_capacity, HIDDEN), dtype=torch.bfloat16, device=dev)
        t0 = time.monotonic()
        step_d, step_c = lambda: a2a.dispatch(x, idx, w, scales), lambda: a2a.combine(expert_out)
        runs.append(("afabric", _timed(step_d, step_c, ns.iters, ns.warmup), _pace(step_d, step_c)))
        if ns.path == "nvlink" and not ns.no_graph:
            gd, gc = _capture(a2a, x, idx, w, scales, expert_out)
            runs.append(("afabric+graph", _timed(gd.replay, gc.replay, ns.iters, ns.warmup),
                         _pace(gd.replay, gc.replay)))  # fmt: skip
            del gd, gc
        a2a.check()
    finally:
        a2a.close()
    for impl, (d, c, hd, hc), (enq, ran) in runs:
        out += [
            asdict(_stats(workload, impl, "dispatch", d, hd)),
            asdict(_stats(workload, impl, "combine", c, hc)),
        ]
        print(f"  rank {rank} {workload} {impl}: p50 dispatch {np.percentile(d, 50):.1f} combine "
              f"{np.percentile(c, 50):.1f} µs; host per call p50 dispatch {np.percentile(hd, 50):.1f} "
              f"combine {np.percentile(hc, 50):.1f} µs; 1000 pairs without events: enqueued "
              f"{enq:.1f} µs/pair, ran {ran:.1f} µs/pair", flush=True)  # fmt: skip
    if rank == 0:
        print(f"  {workload}: afabric {ns.iters} calls in {time.monotonic() - t0:.1f} s", flush=True)
    if ns.no_baseline:
        return out
    nc = NcclAllToAll(world, rank, EXPERTS, dev)
    nc_out = torch.zeros((world * tokens * TOP_K, HIDDEN), dtype=torch.bfloat16, device=dev)
    t0 = time.monotonic()
    iters = ns.baseline_iters or ns.iters
    d, c, hd, hc = _timed(
        lambda: nc.dispatch(x, scales, idx), lambda: nc.combine(nc_out, w, tokens), iters, ns.warmup
    )
    out += [
        asdict(_stats(workload, "nccl", "dispatch", d, hd)),
        asdict(_stats(workload, "nccl", "combine", c, hc)),
    ]
    if rank == 0:
        print(f"  {workload}: nccl {iters} calls in {time.monotonic() - t0:.1f} s", flush=True)
    return out


# ---------------------------------------------------------------- the command


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _collect(procs: list[Any], results: Any, world: int) -> tuple[list[dict[str, Any]], list[str]]:
    """Every rank's rows and errors; then the processes are joined. A rank that exits
    without reporting fails the run at once (the others, waiting on it in NCCL, are killed)."""
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    reported: set[int] = set()
    while len(reported) < world:
        try:
            rank, out, err = results.get(timeout=1)
        except queue.Empty:
            dead = [r for r, p in enumerate(procs) if r not in reported and p.exitcode is not None]
            if dead:
                errors += [f"rank {r} exited with status {procs[r].exitcode} without reporting" for r in dead]
                for p in procs:
                    if p.is_alive():
                        p.kill()
                break
            continue
        reported.add(rank)
        for r in out:
            r["rank"] = rank
        rows += out
        if err:
            errors.append(f"rank {rank}: {err}")
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    return rows, errors


def _worst(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (workload, impl, op), the worst rank's percentiles."""
    merged: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        key = (r["workload"], r["impl"], r["op"])
        m = merged.setdefault(key, dict(r))
        for f in ("p50_us", "p99_us", "mean_us", "max_us"):
            m[f] = max(m[f], r[f])
    return list(merged.values())


def main(ns: argparse.Namespace) -> int:
    for k, v in _NO_MULTICAST.items():
        os.environ.setdefault(k, v)
    harness.require("afabric bench moe", "torch", "cupy")
    harness.check_outputs(ns)
    import torch

    gpus = torch.cuda.device_count()
    world = ns.world or gpus
    if gpus < 1 or world > gpus or world < 1:
        raise harness.CommandError(f"afabric bench moe needs {world or 1} CUDA GPU(s), found {gpus}")
    if ns.quick:
        ns.iters = min(ns.iters, 1000)
    if ns.iters < 1 or ns.warmup < 0 or ns.baseline_iters < 0:
        raise harness.CommandError("--iters must be >= 1 and --warmup >= 0")
    if ns.path == "proxy":
        ns.provider, why = harness.resolve_provider(ns.provider)
        print(why, flush=True)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    args = {k: v for k, v in vars(ns).items() if k not in ("func", "json_stream")}
    print(f"afabric bench moe: path {ns.path}, {world} ranks ({torch.cuda.get_device_name(0)}), "
          f"{ns.iters} calls after {ns.warmup} warm-up", flush=True)  # fmt: skip
    procs = [ctx.Process(target=_rank, args=(r, world, port, args, results)) for r in range(world)]
    for p in procs:
        p.start()
    rows, errors = _collect(procs, results, world)
    worst = _worst(rows)
    _print(worst, ns.path)
    if ns.json:
        doc = {
            "bench": "moe", "path": ns.path, "world": world, "iters": ns.iters, "warmup": ns.warmup,
            "baseline_iters": ns.baseline_iters or ns.iters,
            "device": torch.cuda.get_device_name(0), "host": platform.node(),
            "workload": {"hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "dtype": "fp8",
                         "scales_per_token": HIDDEN // SCALE_BLOCK, "tokens": WORKLOADS},
            "worst_rank": worst, "per_rank": rows, "errors": errors,
            "command": " ".join(["afabric", *sys.argv[1:]]),
        }  # fmt: skip
        harness.write_json(doc, ns)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    return 1 if errors else 0


def _print(rows: list[dict[str, Any]], path: str) -> None:
    by = {(r["workload"], r["impl"], r["op"]): r for r in rows}
    print(f"\n{'workload':15} {'op':9} {'afabric p50':>12} {'p99':>9} {'NCCL p50':>10} {'p99':>9} "
          f"{'NCCL/afabric':>13} {'goal p50':>9}")  # fmt: skip
    for impl in ("afabric", "afabric+graph"):
        for workload in WORKLOADS:
            for op in ("dispatch", "combine"):
                a = by.get((workload, impl, op))
                if a is None:
                    continue
                b = by.get((workload, "nccl", op))
                goal = GOALS_US[(workload, op)] if path == "nvlink" else float("nan")
                nccl = (
                    f"{b['p50_us']:10.1f} {b['p99_us']:9.1f} {b['p50_us'] / a['p50_us']:12.2f}x"
                    if b
                    else " " * 34
                )
                name = f"{workload}{'+graph' if impl != 'afabric' else ''}"
                print(f"{name:15} {op:9} {a['p50_us']:10.1f}us {a['p99_us']:9.1f} {nccl} {goal:9.0f}")
    print("(µs; worst rank; CUDA events around each call; +graph: replays of captured calls)")
