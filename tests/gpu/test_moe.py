"""afabric.moe.AllToAll on real GPUs, one process per GPU, against the torch reference
(tests/gpu/moe_reference.py): every routing scenario (random, empty experts, every token to one
expert, all top-k on one rank, a rank with no tokens, masked entries), bf16 and fp8 with
per-block scales, several calls in a row on the same buffers (both parities, dispatch
repeated without combine, bursts without host syncs), over NVLink and over the host proxy;
on NVLink also dispatch and combine captured into CUDA graphs and replayed on new inputs,
interleaved with eager calls (through the proxy, capturing is refused).

Each rank builds every rank's inputs from a shared seed, runs its own through dispatch,
checks the tokens each of its experts got (as multisets: the order within an expert is
not part of the contract) and the expert counts and offsets, runs a toy expert
(``y = x * factor[e]``) and checks combine. Ranks run as subprocesses of this file (no
pickling of test functions), so the test works with pytest's importlib mode.

Skipped, not faked, without CuPy or CUDA GPUs (failed where AFABRIC_REQUIRE_GPU=1).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
from typing import Any

import pytest

WORLD_MAX = 2


@functools.cache
def _probe() -> tuple[int, str]:
    try:
        import cupy
        import torch
    except Exception as e:  # noqa: BLE001
        return 0, f"CuPy/torch not usable ({type(e).__name__}: {e})"
    try:
        n = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001
        return 0, f"no CUDA GPU ({type(e).__name__}: {e})"
    if n < 1 or not torch.cuda.is_available():
        return 0, "no CUDA GPU"
    return min(n, WORLD_MAX), ""


def _world() -> int:
    n, why = _probe()
    if n == 0:
        if os.environ.get("AFABRIC_REQUIRE_GPU") == "1":
            pytest.fail(f"AFABRIC_REQUIRE_GPU=1 but {why}")
        pytest.skip(why)
    return n


def _run_ranks(path: str, world: int, timeout: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        init = os.path.join(tmp, "init")
        procs = [
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), path, str(r), str(world), init],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )
            for r in range(world)
        ]  # fmt: skip
        outs = []
        for p in procs:
            try:
                out, _ = p.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                out += "\n(timed out)"
            outs.append((p.returncode, out))
        for r, (rc, out) in enumerate(outs):
            print(f"---- rank {r} (exit {rc}) ----\n{out}")
        assert all(rc == 0 for rc, _ in outs), "a rank failed (its output is above)"


@pytest.mark.timeout(400)
def test_moe_nvlink() -> None:
    _run_ranks("nvlink", _world(), 360)


@pytest.mark.timeout(400)
def test_moe_proxy() -> None:
    world = _world()
    if world < 2:
        pytest.skip("the proxy path needs two ranks")
    _run_ranks("proxy", world, 360)


# ---------------------------------------------------------------- one rank


def _fingerprints(rows: Any, seed: int = 7) -> Any:
    import torch

    u8 = rows.contiguous().view(torch.uint8).reshape(rows.shape[0], -1).long()
    g = torch.Generator(device="cpu").manual_seed(seed)
    w = torch.randint(1, 1 << 40, (u8.shape[1],), generator=g, dtype=torch.long)
    return (u8 * w.to(u8.device)).sum(dim=1)


def _same_rows(got: Any, want: Any, what: str) -> None:
    """Equal as multisets of rows (bit-exact)."""
    import torch

    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} rows, expected {tuple(want.shape)}"
    if got.shape[0] == 0:
        return
    kg, kw = _fingerprints(got), _fingerprints(want)
    og, ow = kg.argsort(), kw.argsort()
    assert torch.equal(kg[og], kw[ow]), f"{what}: the received rows differ from the reference"
    a = got[og].contiguous().view(torch.uint8)
    b = want[ow].contiguous().view(torch.uint8)
    assert torch.equal(a, b), f"{what}: rows differ"


def _check_call(a2a: Any, cfg: Any, case: Any, rank: int, dev: Any, f: Any) -> None:
    import moe_reference as ref  # beside this file (see __main__ below)
    import torch

    x = case.x[rank].to(dev)
    idx = case.topk_idx[rank].to(dev)
    w = case.topk_weights[rank].to(dev)
    sc = case.scales[rank].to(dev) if case.scales[rank] is not None else None
    res = a2a.dispatch(x, idx, w, sc)
    inbox = ref.route(cfg, case.topk_idx, rank)
    counts = res.expert_counts.cpu().tolist()
    offsets = res.expert_offsets.cpu().tolist()
    assert counts == inbox.counts, f"expert counts {counts} != reference {inbox.counts}"
    acc = [0]
    for c in counts:
        acc.append(acc[-1] + c)
    assert offsets == acc, f"expert offsets {offsets} != {acc}"
    for e, pairs in enumerate(inbox.pairs):
        lo, hi = offsets[e], offsets[e + 1]
        want = [case.x[s][t] for s, t in pairs]
        want_x = torch.stack(want) if want else case.x[0][:0]
        _same_rows(res.x[lo:hi].cpu(), want_x, f"expert {e} tokens")
        if res.scales is not None:
            ws = [case.scales[s][t] for s, t in pairs]
            sc0 = case.scales[0]
            assert sc0 is not None
            want_s = torch.stack(ws) if ws else sc0[:0]
            # rows and scales travel together: compare (row, scales) pairs as one row
            got_pair = torch.cat(
                [res.x[lo:hi].cpu().view(torch.uint8), res.scales[lo:hi].cpu().view(torch.uint8)], 1
            )
            want_pair = torch.cat([want_x.view(torch.uint8), want_s.view(torch.uint8)], 1)
            _same_rows(got_pair, want_pair, f"expert {e} (token, scales)")
    # toy experts, then combine
    total = acc[-1]
    e_of_row = torch.repeat_interleave(
        torch.arange(cfg.experts_per_rank, device=dev) + rank * cfg.experts_per_rank,
        res.expert_counts.long(),
    )
    vals = ref.dequantize(res.x[:total], None if res.scales is None else res.scales[:total], cfg.scale_block)
    expert_out = torch.zeros((cfg.expert_capacity, cfg.hidden), dtype=a2a.out_dtype, device=dev)
    expert_out[:total] = (vals * f.to(dev)[e_of_row].unsqueeze(1)).to(a2a.out_dtype)
    out = a2a.combine(expert_out).float().cpu()
    want_out = ref.combine(
        ref.dequantize(case.x[rank], case.scales[rank], cfg.scale_block),
        case.topk_idx[rank],
        case.topk_weights[rank],
        f,
    )
    tol = 3e-2 if cfg.out_dtype == "bf16" else 1e-4
    scale = float(want_out.abs().max()) if want_out.numel() else 1.0
    torch.testing.assert_close(out, want_out, rtol=tol, atol=tol * max(scale, 1.0))


def _to(t: Any, dev: Any) -> Any:
    return None if t is None else t.to(dev)


class _Captured:
    """dispatch and combine as CUDA graphs captured once on static tensors; a call copies
    its inputs into them and replays (what a decode loop under torch.cuda.graph does)."""

    def __init__(self, a2a: Any, cfg: Any, case: Any, rank: int, dev: Any) -> None:
        import torch

        self.out_dtype = a2a.out_dtype
        self.x = case.x[rank].to(dev)
        self.idx = case.topk_idx[rank].to(dev)
        self.w = case.topk_weights[rank].to(dev)
        self.sc = _to(case.scales[rank], dev)
        self.eo = torch.zeros((cfg.expert_capacity, cfg.hidden), dtype=a2a.out_dtype, device=dev)
        self.gd, self.gc = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.gd):
            self.res = a2a.dispatch(self.x, self.idx, self.w, self.sc)
        with torch.cuda.graph(self.gc):
            self.out = a2a.combine(self.eo)

    def dispatch(self, x: Any, idx: Any, w: Any, sc: Any) -> Any:
        self.x.copy_(x)
        self.idx.copy_(idx)
        self.w.copy_(w)
        if sc is not None:
            self.sc.copy_(sc)
        self.gd.replay()
        return self.res

    def combine(self, expert_out: Any) -> Any:
        self.eo.copy_(expert_out)
        self.gc.replay()
        return self.out


def _check_graphs(a2a: Any, cfg: Any, rank: int, dev: Any, f: Any, seed: int) -> int:
    """Replays (every token count max_tokens) checked like eager calls, with eager calls
    between some of them so that replays run on both slot parities."""
    import moe_reference as ref  # beside this file (see __main__ below)

    cap = _Captured(a2a, cfg, ref.make_case(cfg, "random", seed), rank, dev)
    for i, scenario in enumerate(("random", "sparse_experts", "one_expert", "same_rank", "random")):
        seed += 1
        _check_call(cap, cfg, ref.make_case(cfg, scenario, seed), rank, dev, f)
        if i % 2 == 0:
            seed += 1
            _check_call(a2a, cfg, ref.make_case(cfg, "random", seed), rank, dev, f)
    a2a.check()
    return seed


def _proxy_refuses_capture(a2a: Any, cfg: Any, rank: int, dev: Any, seed: int) -> None:
    import moe_reference as ref  # beside this file (see __main__ below)
    import torch

    from afabric.errors import UsageError

    case = ref.make_case(cfg, "random", seed)
    args = (case.x[rank].to(dev), case.topk_idx[rank].to(dev), case.topk_weights[rank].to(dev),
            _to(case.scales[rank], dev))  # fmt: skip
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g, capture_error_mode="thread_local"):
            a2a.dispatch(*args)
    except UsageError:
        pass
    else:
        raise AssertionError("capturing a proxy dispatch was not refused")


def _rank_main(path: str, rank: int, world: int, init: str) -> None:
    import moe_reference as ref  # beside this file (see __main__ below)
    import torch
    import torch.distributed as dist

    from afabric.moe import AllToAll, MoeConfig, torch_all_gather

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    gather = torch_all_gather()
    configs = [
        MoeConfig(max_tokens=48, num_experts=6 * world, experts_per_token=4, hidden=256, world_size=world,
                  in_dtype="bf16", out_dtype="bf16"),
        MoeConfig(max_tokens=40, num_experts=8 * world, experts_per_token=5, hidden=384, world_size=world,
                  in_dtype="fp8", out_dtype="bf16", scale_block=128,
                  max_private_tokens=16 if path == "proxy" else None),
        MoeConfig(max_tokens=32, num_experts=4 * world, experts_per_token=2, hidden=128, world_size=world,
                  in_dtype="bf16", out_dtype="fp32"),
    ]  # fmt: skip
    from afabric.moe import alltoall

    # these configurations receive in one kernel (few entries); the fp8 one once more with
    # the routing kernel and the copy kernel that large calls use
    runs = [(0, True), (1, True), (2, True)] + ([(1, False)] if path == "nvlink" else [])
    for ci, fused in runs:
        cfg = configs[ci]
        alltoall.FUSED_RECEIVE_MAX_ENTRIES = 1 << 30 if fused else 0
        a2a = AllToAll(cfg, rank=rank, all_gather=gather, device=rank, path=path, timeout=60.0)
        assert a2a.fused_receive == fused
        f = ref.expert_factors(cfg)
        seed = 1000 * ci + (500 if not fused else 0)
        for rep in range(2):  # every scenario twice: both buffer parities
            for scenario in ref.SCENARIOS:
                seed += 1
                _check_call(a2a, cfg, ref.make_case(cfg, scenario, seed), rank, dev, f)
                what = f"config {ci} {cfg.in_dtype}->{cfg.out_dtype} fused {fused}"
                print(f"rank {rank} {what} {scenario} rep {rep}: ok", flush=True)
        # dispatch three times without combine, then a burst of calls with no host sync
        for _ in range(3):
            seed += 1
            case = ref.make_case(cfg, "random", seed)
            a2a.dispatch(
                case.x[rank].to(dev),
                case.topk_idx[rank].to(dev),
                case.topk_weights[rank].to(dev),
                _to(case.scales[rank], dev),
            )
        for _ in range(20):
            seed += 1
            case = ref.make_case(cfg, "masked_mixed", seed)
            res = a2a.dispatch(
                case.x[rank].to(dev),
                case.topk_idx[rank].to(dev),
                case.topk_weights[rank].to(dev),
                _to(case.scales[rank], dev),
            )
            a2a.combine(torch.zeros((cfg.expert_capacity, cfg.hidden), dtype=a2a.out_dtype, device=dev))
        del res
        _check_call(a2a, cfg, ref.make_case(cfg, "random", seed + 1), rank, dev, f)
        a2a.check()
        print(f"rank {rank} config {ci} fused {fused}: repeated calls ok", flush=True)
        if path == "nvlink":
            seed = _check_graphs(a2a, cfg, rank, dev, f, seed + 2)
            print(f"rank {rank} config {ci} fused {fused}: CUDA-graph replays ok", flush=True)
        else:
            _proxy_refuses_capture(a2a, cfg, rank, dev, seed + 2)
            print(f"rank {rank} config {ci}: capture through the proxy refused", flush=True)
        a2a.close()
    dist.destroy_process_group()
    print(f"rank {rank}: all checks passed ({path})", flush=True)


if __name__ == "__main__":
    # moe_reference.py lies beside this file; put its directory on sys.path explicitly
    # (PYTHONSAFEPATH=1, which the GPU scripts set, keeps a script's directory off it)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    _rank_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
