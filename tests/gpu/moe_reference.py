"""Plain torch reference of dispatch and combine (any device, no communication).

Given every rank's routing, it says which (source rank, token) pairs each local expert of
a rank receives, and what combine must return: the tests check the kernels against it.
Test code, not product (it was afabric/moe/reference.py): tests/test_moe.py imports it as
``tests.gpu.moe_reference``, the GPU test's rank processes (``python tests/gpu/test_moe.py``,
which puts this directory on sys.path) as ``moe_reference``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from afabric.moe.config import MoeConfig

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ExpertInbox:
    """For one rank: per local expert, the (source rank, token) pairs it receives, in
    (source, token) order."""

    pairs: list[list[tuple[int, int]]]

    @property
    def counts(self) -> list[int]:
        return [len(p) for p in self.pairs]


def route(cfg: MoeConfig, topk_idx: list[torch.Tensor], rank: int) -> ExpertInbox:
    """Which tokens of which source reach each local expert of ``rank``. Negative ids
    route nowhere; ``topk_idx[src]`` is that source's ``[n, k]`` routing."""
    e_local = cfg.experts_per_rank
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(e_local)]
    lo, hi = rank * e_local, (rank + 1) * e_local
    for src, idx in enumerate(topk_idx):
        for t, row in enumerate(idx.tolist()):
            for e in row:
                if lo <= e < hi:
                    pairs[e - lo].append((src, t))
    return ExpertInbox(pairs)


def dequantize(x: torch.Tensor, scales: torch.Tensor | None, block: int) -> torch.Tensor:
    """fp32 values of bf16 rows, or of fp8 rows with per-block fp32 scales."""
    v = x.float()
    if scales is None:
        return v
    n, h = v.shape
    return (v.view(n, h // block, block) * scales.float().unsqueeze(-1)).view(n, h)


def combine(
    values: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, expert_fn: torch.Tensor
) -> torch.Tensor:
    """Reference combine for one source rank, with a toy expert ``y = x * expert_fn[e]``:
    ``out[t] = sum_k w[t, k] * expert_fn[idx[t, k]] * values[t]`` over ids >= 0 (fp32)."""
    idx = topk_idx.long()
    valid = idx >= 0
    factor = expert_fn[idx.clamp(min=0)] * topk_weights.float() * valid
    return values.float() * factor.sum(dim=1, keepdim=True)


SCENARIOS = ("random", "sparse_experts", "one_expert", "same_rank", "empty_rank", "masked_mixed")


@dataclass(frozen=True)
class Case:
    """Every rank's inputs for one call (CPU tensors): ``x[r]`` ``[n_r, hidden]`` (bf16,
    or fp8 with ``scales[r]``), ``topk_idx[r]`` int32 and ``topk_weights[r]`` float32."""

    x: list[torch.Tensor]
    scales: list[torch.Tensor | None]
    topk_idx: list[torch.Tensor]
    topk_weights: list[torch.Tensor]


def make_case(cfg: MoeConfig, scenario: str, seed: int) -> Case:
    """Deterministic inputs for all ranks (every rank can build every rank's):

    - ``random``: top-k of random scores, every rank full;
    - ``sparse_experts``: only every third expert is ever chosen (the rest stay empty);
    - ``one_expert``: every token goes to expert 0 only (other slots -1);
    - ``same_rank``: all k experts of a token live on one rank;
    - ``empty_rank``: rank 0 sends no tokens, the others different numbers;
    - ``masked_mixed``: varying token counts and random -1 (no expert) entries.
    """
    import torch

    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r}")
    g = torch.Generator().manual_seed(seed)
    n_ranks, t_max, k, e = cfg.world_size, cfg.max_tokens, cfg.experts_per_token, cfg.num_experts
    e_local = cfg.experts_per_rank
    xs: list[torch.Tensor] = []
    ss: list[torch.Tensor | None] = []
    idxs: list[torch.Tensor] = []
    ws: list[torch.Tensor] = []
    for r in range(n_ranks):
        n = t_max
        if scenario == "empty_rank":
            n = 0 if r == 0 else max(1, t_max - 3 * r)
        elif scenario == "masked_mixed":
            n = int(torch.randint(0, t_max + 1, (1,), generator=g))
        scores = torch.rand(n, e, generator=g)
        if scenario == "sparse_experts":
            allowed = torch.arange(e) % 3 == 0
            scores[:, ~allowed] = -1.0
            idx = scores.topk(min(k, int(allowed.sum())), dim=1).indices
            if idx.shape[1] < k:
                idx = torch.cat([idx, torch.full((n, k - idx.shape[1]), -1, dtype=idx.dtype)], dim=1)
        elif scenario == "one_expert":
            idx = torch.full((n, k), -1, dtype=torch.long)
            idx[:, 0] = 0
        elif scenario == "same_rank":
            dst = torch.randint(0, n_ranks, (n,), generator=g)
            local = torch.rand(n, e_local, generator=g).topk(min(k, e_local), dim=1).indices
            idx = torch.full((n, k), -1, dtype=torch.long)
            idx[:, : local.shape[1]] = local + (dst * e_local).unsqueeze(1)
        else:
            idx = scores.topk(k, dim=1).indices
        if scenario == "masked_mixed":
            idx[torch.rand(n, k, generator=g) < 0.25] = -1
        ws.append(torch.rand(n, k, generator=g, dtype=torch.float32))
        idxs.append(idx.to(torch.int32))
        v = torch.randn(n, cfg.hidden, generator=g)
        if cfg.in_dtype == "fp8":
            xs.append(v.clamp(-8, 8).to(torch.float8_e4m3fn))
            ss.append(torch.rand(n, cfg.scales_per_token, generator=g) + 0.5)
        else:
            xs.append(v.to(torch.bfloat16))
            ss.append(None)
    return Case(xs, ss, idxs, ws)


def expert_factors(cfg: MoeConfig) -> torch.Tensor:
    """The toy experts of the tests: expert ``e`` multiplies its input by this factor."""
    import torch

    return 1.0 + torch.arange(cfg.num_experts, dtype=torch.float32) / cfg.num_experts
