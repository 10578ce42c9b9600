"""Model descriptions: the training parameters of a transformer (Hugging Face names) and
how an inference deployment shards them, for the benchmark and for planning at scale.

Presets carry the published configurations (``config.json`` of each model on the
Hugging Face hub):

- DeepSeek-V3 (671B): hidden_size 7168, num_hidden_layers 61, first_k_dense_replace 3,
  intermediate_size 18432, moe_intermediate_size 2048, n_routed_experts 256,
  n_shared_experts 1, num_attention_heads 128, q_lora_rank 1536, kv_lora_rank 512,
  qk_nope_head_dim 128, qk_rope_head_dim 64, v_head_dim 128, vocab_size 129280.
- Kimi-K2 (1T, moonshotai/Kimi-K2-Instruct, DeepSeek-V3 architecture): hidden_size 7168,
  num_hidden_layers 61, first_k_dense_replace 1, intermediate_size 18432,
  moe_intermediate_size 2048, n_routed_experts 384, n_shared_experts 1,
  num_attention_heads 64, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128,
  qk_rope_head_dim 64, v_head_dim 128, vocab_size 163840.
- Qwen3-235B-A22B: hidden_size 4096, num_hidden_layers 94 (all MoE), num_attention_heads 64,
  num_key_value_heads 4, head_dim 128 (with q/k RMSNorm), moe_intermediate_size 1536,
  num_experts 128, vocab_size 151936, tie_word_embeddings false.

The multi-token-prediction layer of DeepSeek-V3 is not part of the 671B main model and is
left out. Inference follows vLLM's layout: attention and dense MLPs tensor-parallel
(q/k/v, gate/up and DeepSeek's q_a/kv_a fused), routed experts spread whole over the ranks
of a replica (expert parallel, gate/up fused as ``w13``), embeddings split by vocabulary,
norms and the router replicated; with fp8, the linear layers (not embeddings, router or
lm_head) are fp8 with 128x128 tile scales, as the published fp8 checkpoints are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..errors import InvalidArgument
from .layout import FP8, DestTensor, Part, RankLayout
from .meta import Box, Placement, SourceParam, chunk_range


@dataclass(frozen=True)
class ModelShape:
    """A model's published shape, as much of it as a weight-transfer plan needs (layers,
    widths, heads, experts, the inference replica size); ``PRESETS`` holds the known ones."""

    name: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    intermediate: int  # dense MLP
    first_dense: int  # layers before the first MoE layer
    experts: int
    moe_intermediate: int
    shared_experts: int = 0
    # GQA attention (kv_heads > 0) or MLA (q_lora_rank > 0)
    kv_heads: int = 0
    head_dim: int = 0
    qk_norm: bool = False
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    score_bias: bool = False  # DeepSeek's e_score_correction_bias (float32)
    replica: int = 8  # inference ranks per replica in a typical deployment (planning default)

    @property
    def mla(self) -> bool:
        return self.q_lora_rank > 0


PRESETS: dict[str, ModelShape] = {
    "deepseek-v3": ModelShape(
        "DeepSeek-V3 (671B)", replica=16, layers=61, hidden=7168, vocab=129280, heads=128, intermediate=18432,
        first_dense=3, experts=256, moe_intermediate=2048, shared_experts=1, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, score_bias=True,
    ),
    "kimi-k2": ModelShape(
        "Kimi-K2 (1T)", replica=16, layers=61, hidden=7168, vocab=163840, heads=64, intermediate=18432,
        first_dense=1, experts=384, moe_intermediate=2048, shared_experts=1, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, score_bias=True,
    ),
    "qwen3-235b": ModelShape(
        "Qwen3-235B-A22B", replica=8, layers=94, hidden=4096, vocab=151936, heads=64, intermediate=12288,
        first_dense=0, experts=128, moe_intermediate=1536, kv_heads=4, head_dim=128, qk_norm=True,
    ),
}  # fmt: skip
"""The shapes ``afabric weights plan --model`` knows, by name."""


def small_model(
    *,
    layers: int = 2,
    hidden: int = 512,
    experts: int = 4,
    moe_intermediate: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 128,
    vocab: int = 1024,
    first_dense: int = 1,
    intermediate: int | None = None,
) -> ModelShape:
    """A GQA MoE model of any size (the benchmark's and the tests' model)."""
    return ModelShape(
        f"custom ({layers} layers, hidden {hidden}, {experts} experts)", layers=layers, hidden=hidden,
        vocab=vocab, heads=heads, intermediate=intermediate or 2 * hidden, first_dense=first_dense,
        experts=experts, moe_intermediate=moe_intermediate, kv_heads=kv_heads, head_dim=head_dim,
        qk_norm=True,
    )  # fmt: skip


def training_params(m: ModelShape) -> list[tuple[str, tuple[int, ...], str]]:
    """``(name, shape, dtype)`` of every training parameter (bf16; the router bias fp32)."""
    bf = "bfloat16"
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (m.vocab, m.hidden), bf)]
    for li in range(m.layers):
        p = f"model.layers.{li}."
        out += [(p + "input_layernorm.weight", (m.hidden,), bf),
                (p + "post_attention_layernorm.weight", (m.hidden,), bf)]  # fmt: skip
        a = p + "self_attn."
        if m.mla:
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            out += [
                (a + "q_a_proj.weight", (m.q_lora_rank, m.hidden), bf),
                (a + "q_a_layernorm.weight", (m.q_lora_rank,), bf),
                (a + "q_b_proj.weight", (m.heads * qk, m.q_lora_rank), bf),
                (a + "kv_a_proj_with_mqa.weight", (m.kv_lora_rank + m.qk_rope_head_dim, m.hidden), bf),
                (a + "kv_a_layernorm.weight", (m.kv_lora_rank,), bf),
                (a + "kv_b_proj.weight", (m.heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), bf),
                (a + "o_proj.weight", (m.hidden, m.heads * m.v_head_dim), bf),
            ]
        else:
            out += [
                (a + "q_proj.weight", (m.heads * m.head_dim, m.hidden), bf),
                (a + "k_proj.weight", (m.kv_heads * m.head_dim, m.hidden), bf),
                (a + "v_proj.weight", (m.kv_heads * m.head_dim, m.hidden), bf),
                (a + "o_proj.weight", (m.hidden, m.heads * m.head_dim), bf),
            ]
            if m.qk_norm:
                out += [(a + "q_norm.weight", (m.head_dim,), bf), (a + "k_norm.weight", (m.head_dim,), bf)]
        mlp = p + "mlp."
        if li < m.first_dense:
            out += _mlp(mlp, m.intermediate, m.hidden)
            continue
        out.append((mlp + "gate.weight", (m.experts, m.hidden), bf))
        if m.score_bias:
            out.append((mlp + "gate.e_score_correction_bias", (m.experts,), "float32"))
        for e in range(m.experts):
            out += _mlp(f"{mlp}experts.{e}.", m.moe_intermediate, m.hidden)
        if m.shared_experts:
            out += _mlp(mlp + "shared_experts.", m.moe_intermediate * m.shared_experts, m.hidden)
    out += [("model.norm.weight", (m.hidden,), bf), ("lm_head.weight", (m.vocab, m.hidden), bf)]
    return out


def _mlp(prefix: str, inter: int, hidden: int) -> list[tuple[str, tuple[int, ...], str]]:
    return [(prefix + "gate_proj.weight", (inter, hidden), "bfloat16"),
            (prefix + "up_proj.weight", (inter, hidden), "bfloat16"),
            (prefix + "down_proj.weight", (hidden, inter), "bfloat16")]  # fmt: skip


def param_count(m: ModelShape) -> int:
    return sum(math.prod(s) for _n, s, _d in training_params(m))


def fsdp_sources(m: ModelShape, trainers: list[int], shard_group: int | None = None) -> list[SourceParam]:
    """Every parameter sharded on dimension 0 over the trainers (FSDP), or with
    ``shard_group`` G: sharded over groups of G ranks and replicated across groups (HSDP,
    mesh ``(N/G, G)``, placements ``(Replicate(), Shard(0))``)."""
    n = len(trainers)
    g = shard_group or n
    if g <= 0 or n % g:
        raise InvalidArgument(f"shard group {g} does not divide {n} trainers")
    mesh_shape = (n // g, g) if g != n else (n,)
    placements = (Placement(), Placement(0)) if g != n else (Placement(0),)
    return [SourceParam(name, shape, dt, mesh_shape, tuple(trainers), placements)
            for name, shape, dt in training_params(m)]  # fmt: skip


def moe_sources(
    m: ModelShape, trainers: list[int], shard_group: int, expert_parallel: int
) -> list[SourceParam]:
    """How MoE models are trained at scale: routed experts expert-parallel (expert ``e``
    whole on rank ``e mod EP`` of each of the ``N / EP`` replicas), everything else HSDP
    (sharded over groups of ``shard_group`` ranks, replicated across groups)."""
    n = len(trainers)
    ep = expert_parallel
    if ep <= 0 or n % ep:
        raise InvalidArgument(f"expert parallel size {ep} does not divide {n} trainers")
    dense = {s.name: s for s in fsdp_sources(m, trainers, shard_group)}
    out = []
    for name, shape, dt in training_params(m):
        parts = name.split(".")
        if "experts" in parts:
            e = int(parts[parts.index("experts") + 1])
            ranks = tuple(trainers[k * ep + e % ep] for k in range(n // ep))
            out.append(SourceParam(name, shape, dt, (len(ranks),), ranks, (Placement(),)))
        else:
            out.append(dense[name])
    return out


def default_expert_parallel(m: ModelShape, trainers: int) -> int:
    """The largest expert-parallel size dividing both the trainers and the experts."""
    return math.gcd(trainers, m.experts) if m.experts else 1


def _split(name: str, n: int, parts: int, t: int) -> tuple[int, int]:
    if n % parts:
        raise InvalidArgument(f"{name}: {n} does not split evenly over {parts} tensor-parallel ranks")
    return chunk_range(0, n, parts, t)


def _rows(r: tuple[int, int], cols: int) -> Box:
    return (r, (0, cols))


def _whole(dst: str, src: str, shape: tuple[int, ...], dtype: str = "bfloat16") -> DestTensor:
    return DestTensor(dst, dtype, (Part(src, tuple((0, n) for n in shape)),))


def _mla(m: ModelShape, tp: int, t: int, lin: str, a: str, q: str) -> list[DestTensor]:
    """DeepSeek's multi-head latent attention: q_a and kv_a fused and replicated, q_b and
    kv_b split by heads, o_proj by its input columns."""
    h = m.hidden
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    kvd = m.qk_nope_head_dim + m.v_head_dim
    vd = m.v_head_dim
    hr = _split("heads", m.heads, tp, t)
    kva = m.kv_lora_rank + m.qk_rope_head_dim
    return [
        DestTensor(q + "fused_qkv_a_proj", lin, (Part(a + "q_a_proj.weight", _rows((0, m.q_lora_rank), h)),
                                                 Part(a + "kv_a_proj_with_mqa.weight", _rows((0, kva), h)))),
        _whole(q + "q_a_layernorm", a + "q_a_layernorm.weight", (m.q_lora_rank,)),
        _whole(q + "kv_a_layernorm", a + "kv_a_layernorm.weight", (m.kv_lora_rank,)),
        DestTensor(q + "q_b_proj", lin,
                   (Part(a + "q_b_proj.weight", _rows((hr[0] * qk, hr[1] * qk), m.q_lora_rank)),)),
        DestTensor(q + "kv_b_proj", lin,
                   (Part(a + "kv_b_proj.weight", _rows((hr[0] * kvd, hr[1] * kvd), m.kv_lora_rank)),)),
        DestTensor(q + "o_proj", lin, (Part(a + "o_proj.weight", ((0, h), (hr[0] * vd, hr[1] * vd))),)),
    ]  # fmt: skip


def _gqa(m: ModelShape, tp: int, t: int, lin: str, a: str, q: str) -> list[DestTensor]:
    """Grouped-query attention: q/k/v fused and split by heads (a rank keeps a copy of its
    key/value head when there are fewer than ranks), o_proj split by input columns."""
    h, d = m.hidden, m.head_dim
    hr = _split("heads", m.heads, tp, t)
    if m.kv_heads >= tp:
        kr = _split("kv heads", m.kv_heads, tp, t)
    else:
        k = t * m.kv_heads // tp
        kr = (k, k + 1)
    out = [
        DestTensor(q + "qkv_proj", lin, (Part(a + "q_proj.weight", _rows((hr[0] * d, hr[1] * d), h)),
                                         Part(a + "k_proj.weight", _rows((kr[0] * d, kr[1] * d), h)),
                                         Part(a + "v_proj.weight", _rows((kr[0] * d, kr[1] * d), h)))),
        DestTensor(q + "o_proj", lin, (Part(a + "o_proj.weight", ((0, h), (hr[0] * d, hr[1] * d))),)),
    ]  # fmt: skip
    if m.qk_norm:
        out += [
            _whole(q + "q_norm", a + "q_norm.weight", (d,)),
            _whole(q + "k_norm", a + "k_norm.weight", (d,)),
        ]
    return out


def _moe(m: ModelShape, tp: int, t: int, lin: str, mlp: str, q: str) -> list[DestTensor]:
    """Router replicated; routed experts whole, spread over the replica's ranks (w13 = gate
    and up fused); shared experts tensor-parallel."""
    h, mi = m.hidden, m.moe_intermediate
    out = [_whole(q + "mlp.gate", mlp + "gate.weight", (m.experts, h))]
    if m.score_bias:
        out.append(_whole(q + "mlp.e_score_correction_bias", mlp + "gate.e_score_correction_bias",
                          (m.experts,), "float32"))  # fmt: skip
    for e in range(*chunk_range(0, m.experts, tp, t)):
        src = f"{mlp}experts.{e}."
        out.append(
            DestTensor(
                f"{q}mlp.experts.{e}.w13",
                lin,
                (
                    Part(src + "gate_proj.weight", _rows((0, mi), h)),
                    Part(src + "up_proj.weight", _rows((0, mi), h)),
                ),
            )
        )
        out.append(
            DestTensor(f"{q}mlp.experts.{e}.w2", lin, (Part(src + "down_proj.weight", ((0, h), (0, mi))),))
        )
    if m.shared_experts:
        out += _tp_mlp(
            q + "mlp.shared_experts.", mlp + "shared_experts.", mi * m.shared_experts, h, tp, t, lin
        )
    return out  # fmt: skip


def rank_tensors(m: ModelShape, tp: int, t: int, fp8: bool) -> list[DestTensor]:
    """The tensors inference rank ``t`` of a ``tp``-rank replica holds."""
    lin = FP8 if fp8 else "bfloat16"
    h = m.hidden
    vr = chunk_range(0, m.vocab, tp, t)
    out = [DestTensor("embed_tokens", "bfloat16", (Part("model.embed_tokens.weight", _rows(vr, h)),))]
    for li in range(m.layers):
        p, q = f"model.layers.{li}.", f"layers.{li}."
        out.append(_whole(q + "input_layernorm", p + "input_layernorm.weight", (h,)))
        out.append(_whole(q + "post_attention_layernorm", p + "post_attention_layernorm.weight", (h,)))
        out += (_mla if m.mla else _gqa)(m, tp, t, lin, p + "self_attn.", q)
        if li < m.first_dense:
            out += _tp_mlp(q + "mlp.", p + "mlp.", m.intermediate, h, tp, t, lin)
        else:
            out += _moe(m, tp, t, lin, p + "mlp.", q)
    out.append(_whole("norm", "model.norm.weight", (h,)))
    out.append(DestTensor("lm_head", "bfloat16", (Part("lm_head.weight", _rows(vr, h)),)))
    return out


def _tp_mlp(dst: str, src: str, inter: int, h: int, tp: int, t: int, dtype: str) -> list[DestTensor]:
    ir = _split(f"{src} intermediate", inter, tp, t)
    return [
        DestTensor(dst + "gate_up_proj", dtype, (Part(src + "gate_proj.weight", _rows(ir, h)),
                                                 Part(src + "up_proj.weight", _rows(ir, h)))),
        DestTensor(dst + "down_proj", dtype, (Part(src + "down_proj.weight", ((0, h), ir)),)),
    ]  # fmt: skip


def inference_layouts(m: ModelShape, ranks: int, tp: int, trainers: int, fp8: bool) -> list[RankLayout]:
    """One layout per inference rank: ``ranks / tp`` replicas of ``tp`` ranks each."""
    if tp <= 0 or ranks % tp:
        raise InvalidArgument(f"tensor-parallel size {tp} does not divide {ranks} inference ranks")
    per = [RankLayout(rank_tensors(m, tp, t, fp8), trainers) for t in range(tp)]
    return [per[i % tp] for i in range(ranks)]


def with_layers(m: ModelShape, layers: int) -> ModelShape:
    return replace(m, layers=layers, first_dense=min(m.first_dense, layers))
