"""MoE all-to-all configuration and buffer sizing (pure Python: no CUDA needed).

Every number a kernel or the proxy relies on is derived here once, so the receive buffers,
the kernels' slot layout and the proxy's write lengths can never disagree.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from ..errors import InvalidArgument

IN_DTYPES = ("bf16", "fp8")
OUT_DTYPES = ("bf16", "fp32")
MAX_RANKS = 64  # kernels keep one bit per rank in a 64-bit mask
MAX_TOP_K = 32  # one lane of a warp per top-k entry
_ALIGN = 16


def _align(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


def _positive(name: str, value: object, hi: int = 1 << 31) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < hi:
        raise InvalidArgument(f"{name} must be an int in 1..{hi - 1}, got {value!r}")
    return value


@dataclass(frozen=True)
class SlotLayout:
    """Byte layout of one staging slot: what one source sends one destination per call.

    ``[0, 16)`` header (int32 token count), then ``T*K`` int32 destination-local experts,
    ``T*K`` float32 routing weights, and ``T`` rows of ``row_bytes`` (the token, then its
    fp32 scales for fp8)."""

    off_experts: int
    off_weights: int
    off_rows: int
    row_bytes: int
    slot_bytes: int
    seg_x: int  # bytes of the token's values in a row
    seg_scales: int  # bytes of its scales (0 for bf16)

    def private_bytes(self, tokens: int) -> int:
        """Bytes from the slot's start through ``tokens`` rows (header and routes included)."""
        return self.off_rows + tokens * self.row_bytes


@dataclass(frozen=True)
class MoeConfig:
    """Shape of one MoE layer's all-to-all, identical on every rank.

    ``node_of[r]`` names the node of rank ``r``: ranks sharing a node exchange tokens over
    NVLink (CUDA IPC), the others through the host proxy. ``None``: all on one node.
    ``max_private_tokens``: tokens per peer the proxy sends speculatively with the routes
    (``None``: all of ``max_tokens``, one write per peer and call)."""

    max_tokens: int
    num_experts: int
    experts_per_token: int
    hidden: int
    world_size: int
    in_dtype: str = "bf16"
    out_dtype: str = "bf16"
    scale_block: int = 128
    node_of: tuple[int, ...] | None = None
    max_private_tokens: int | None = None
    nodes: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _positive("max_tokens", self.max_tokens, 1 << 24)
        _positive("num_experts", self.num_experts, 1 << 16)
        _positive("experts_per_token", self.experts_per_token, MAX_TOP_K + 1)
        _positive("hidden", self.hidden, 1 << 20)
        _positive("world_size", self.world_size, MAX_RANKS + 1)
        if self.in_dtype not in IN_DTYPES:
            raise InvalidArgument(f"in_dtype must be one of {IN_DTYPES}, got {self.in_dtype!r}")
        if self.out_dtype not in OUT_DTYPES:
            raise InvalidArgument(f"out_dtype must be one of {OUT_DTYPES}, got {self.out_dtype!r}")
        if self.num_experts % self.world_size:
            raise InvalidArgument(
                f"num_experts {self.num_experts} is not a multiple of world_size {self.world_size}"
            )
        if self.experts_per_token > self.num_experts:
            raise InvalidArgument(
                f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}"
            )
        if self.hidden % _ALIGN:
            raise InvalidArgument(f"hidden {self.hidden} must be a multiple of {_ALIGN}")
        if self.in_dtype == "fp8":
            _positive("scale_block", self.scale_block, 1 << 20)
            if self.hidden % self.scale_block:
                raise InvalidArgument(
                    f"hidden {self.hidden} must be a multiple of scale_block {self.scale_block}"
                )
        nodes = tuple(self.node_of) if self.node_of is not None else (0,) * self.world_size
        if len(nodes) != self.world_size or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in nodes
        ):
            raise InvalidArgument(f"node_of must give a node number >= 0 for each of {self.world_size} ranks")
        object.__setattr__(self, "nodes", nodes)
        if self.max_private_tokens is not None:
            p = self.max_private_tokens
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= self.max_tokens:
                raise InvalidArgument(f"max_private_tokens must be an int in 0..{self.max_tokens}, got {p!r}")

    # ---- derived sizes ----

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    @property
    def scales_per_token(self) -> int:
        return self.hidden // self.scale_block if self.in_dtype == "fp8" else 0

    @property
    def in_itemsize(self) -> int:
        return 1 if self.in_dtype == "fp8" else 2

    @property
    def out_itemsize(self) -> int:
        return 4 if self.out_dtype == "fp32" else 2

    @property
    def private_tokens(self) -> int:
        return self.max_tokens if self.max_private_tokens is None else self.max_private_tokens

    @property
    def expert_capacity(self) -> int:
        """Rows of the expert-major receive buffer: N·T·min(R, E/N).

        Each of N sources sends at most T tokens, and one token lands at most once in each
        local expert and at most R times in all (its top-R experts are distinct), so a rank
        never receives more entries than this. (The paper states the bound as
        N·T·max(R, E/N); min is the tight form of the same argument.)"""
        n, t, r = self.world_size, self.max_tokens, self.experts_per_token
        return n * t * min(r, self.experts_per_rank)

    def slot_layout(self) -> SlotLayout:
        t, k = self.max_tokens, self.experts_per_token
        off_experts = _ALIGN
        off_weights = _align(off_experts + 4 * t * k)
        off_rows = _align(off_weights + 4 * t * k)
        seg_x = self.hidden * self.in_itemsize
        seg_scales = 4 * self.scales_per_token
        row_bytes = _align(seg_x + seg_scales)
        return SlotLayout(
            off_experts=off_experts,
            off_weights=off_weights,
            off_rows=off_rows,
            row_bytes=row_bytes,
            slot_bytes=_align(off_rows + t * row_bytes, 256),
            seg_x=seg_x,
            seg_scales=seg_scales,
        )

    @property
    def combine_slot_bytes(self) -> int:
        """One source's partial sums from one expert rank: T rows of ``hidden`` outputs."""
        return _align(self.max_tokens * self.hidden * self.out_itemsize, 256)

    def same_node(self, a: int, b: int) -> bool:
        return self.nodes[a] == self.nodes[b]

    def fingerprint(self) -> bytes:
        """16 bytes that differ between configurations the ranks could disagree on."""
        text = repr(
            (
                self.max_tokens, self.num_experts, self.experts_per_token, self.hidden,
                self.world_size, self.in_dtype, self.out_dtype, self.scale_block, self.nodes,
                self.private_tokens,
            )
        )  # fmt: skip
        return hashlib.sha256(text.encode()).digest()[:16]


@dataclass(frozen=True)
class BufferSizes:
    """Bytes each rank allocates, by where they live."""

    device_staging: int  # GPU memory mapped into same-node peers (CUDA IPC)
    device_outputs: int  # expert-major tokens and scales, route tables, combine output
    host_pinned: int  # proxy send/receive regions (0 without proxy peers)


def buffer_sizes(cfg: MoeConfig, proxy_peers: int) -> BufferSizes:
    """What :class:`afabric.moe.AllToAll` will allocate for ``cfg`` with ``proxy_peers``
    ranks behind the host proxy."""
    n, t, k = cfg.world_size, cfg.max_tokens, cfg.experts_per_token
    lay = cfg.slot_layout()
    staging = 2 * n * (lay.slot_bytes + cfg.combine_slot_bytes) + 2 * n * 8
    cap = cfg.expert_capacity
    outputs = (
        cap * (lay.seg_x + lay.seg_scales) + t * cfg.hidden * cfg.out_itemsize + n * t * k * 8 + t * n * 4
    )
    host = 0
    if proxy_peers:
        host = 2 * 2 * n * (lay.slot_bytes + cfg.combine_slot_bytes) + 4096
    return BufferSizes(staging, outputs, host)
