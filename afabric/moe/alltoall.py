"""``AllToAll``: MoE dispatch and combine between ranks (one process per GPU).

Each rank allocates one staging buffer in GPU memory (per source and call parity: a
dispatch slot and a combine slot, plus epoch flags) and hands its CUDA IPC handle to the
ranks on its node, which map it and store into it directly over NVLink. Ranks on other
nodes (or every other rank with ``path="proxy"``) go through the host proxy
(:mod:`afabric.moe.proxy`). Calls are stream-ordered on torch's current stream and never
synchronize with the host: they return once the kernels are enqueued.

Two slots per source, used by call parity, are enough: a rank cannot send call ``s + 2``
before its own call ``s + 1`` received from every peer, which each peer sent only after
finishing its call ``s`` (stream order), the last reader of the slot ``s + 2`` reuses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EngineClosed, InvalidArgument, OperationTimeout, UsageError
from . import control
from .config import MoeConfig
from .kernels import COPY_THREADS, ERR_CAPACITY, ERR_EXPERT, ERR_TIMEOUT, ROUTE_THREADS, Kernels, layout_words

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from .proxy import Proxy

AllGather = Callable[[bytes], Sequence[bytes]]
"""Collective: every rank passes its bytes and gets every rank's, in rank order."""

PATHS = ("auto", "nvlink", "proxy")
_TABLES = 8  # dispatch dst slot/flag, src slot/flag; combine the same
_SCRATCH = (
    "_layout",
    "_ctr",
    "_err",
    "_slot_of",
    "_pos",
    "_wts",
    "_ntok",
    "_counts",
    "_offsets",
    "_x_out",
    "_out",
)


def torch_all_gather(group: Any = None) -> AllGather:
    """An :data:`AllGather` over a ``torch.distributed`` process group (default: world)."""
    import torch.distributed as dist

    def gather(data: bytes) -> list[bytes]:
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, data, group=group)
        return [bytes(b) for b in out]

    return gather


def _proxy_peers(cfg: MoeConfig, rank: int, path: str) -> list[int]:
    """Ranks reached through the host proxy: other nodes', or all others for "proxy"."""
    n = cfg.world_size
    if path == "proxy":
        return [r for r in range(n) if r != rank]
    if path == "nvlink" and len(set(cfg.nodes)) != 1:
        raise InvalidArgument("path='nvlink' needs every rank on one node (node_of)")
    return [r for r in range(n) if not cfg.same_node(rank, r)]


def _check_args(config: MoeConfig, rank: int, path: str, tag: int, timeout: float) -> None:
    if not isinstance(config, MoeConfig):
        raise InvalidArgument(f"config must be a MoeConfig, got {type(config).__name__}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < config.world_size:
        raise InvalidArgument(f"rank must be in 0..{config.world_size - 1}, got {rank!r}")
    if path not in PATHS:
        raise InvalidArgument(f"path must be one of {PATHS}, got {path!r}")
    if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag < 1 << 15:
        raise InvalidArgument(f"tag must be an int in 0..32767, got {tag!r}")
    if not isinstance(timeout, (int, float)) or not 0 < timeout < 1e6:
        raise InvalidArgument(f"timeout must be a number of seconds > 0, got {timeout!r}")


@dataclass(frozen=True)
class DispatchResult:
    """Tokens for this rank's experts, expert-major: rows ``expert_offsets[e]`` up to
    ``expert_offsets[e + 1]`` of ``x`` (and ``scales`` for fp8) belong to local expert
    ``e``; ``expert_counts[e]`` is their number. Device tensors, valid until the next
    dispatch; rows past ``expert_offsets[-1]`` are unused."""

    x: torch.Tensor
    scales: torch.Tensor | None
    expert_counts: torch.Tensor
    expert_offsets: torch.Tensor


class AllToAll:
    """Dispatch tokens to their top-k experts and combine the experts' outputs.

    Collective: every rank constructs it with the same :class:`MoeConfig`, then calls
    ``dispatch`` and ``combine`` the same number of times, in the same order, and finally
    ``close``. ``all_gather`` is used at setup and close only.
    """

    def __init__(
        self,
        config: MoeConfig,
        *,
        rank: int,
        all_gather: AllGather,
        device: int | None = None,
        path: str = "auto",
        provider: str = "tcp",
        tag: int = 0,
        timeout: float = 30.0,
    ) -> None:
        import cupy
        import torch

        _check_args(config, rank, path, tag, timeout)
        self.cfg = cfg = config
        self.rank = rank
        self.device = int(torch.cuda.current_device() if device is None else device)
        self._gather, self._timeout_ns, self._closed = all_gather, int(timeout * 1e9), True
        n = cfg.world_size
        self.proxy_peers = _proxy_peers(cfg, rank, path)
        self.nvlink_peers = [r for r in range(n) if r not in self.proxy_peers]
        self.path = "proxy" if self.proxy_peers else "nvlink"

        torch.cuda.set_device(self.device)
        cupy.cuda.Device(self.device).use()
        self._torch = torch
        self._k = Kernels(cfg, self.device)
        lay = self._lay = cfg.slot_layout()
        self._dslot, self._cslot = lay.slot_bytes, cfg.combine_slot_bytes
        self._comb_base = 2 * n * self._dslot
        self._flag_base = self._comb_base + 2 * n * self._cslot
        self.staging_bytes = self._flag_base + 2 * n * 8
        rt = cupy.cuda.runtime
        self._staging = int(rt.malloc(self.staging_bytes))
        self._opened: list[int] = []
        self.proxy: Proxy | None = None
        try:
            rt.memset(self._staging, 0, self.staging_bytes)
            rt.deviceSynchronize()
            handle = bytes(rt.ipcGetMemHandle(self._staging)) if len(self.nvlink_peers) > 1 else b""
            descs: tuple[bytes, ...] = ()
            address = b""
            if self.proxy_peers:
                from .proxy import Proxy

                self.proxy = Proxy(cfg, rank, self.proxy_peers, provider, tag, self.device)
                descs = self.proxy.descs()
                address = bytes(self.proxy.eng.address)
            me = control.PeerInfo(
                rank, n, cfg.nodes[rank], cfg.fingerprint(), self.staging_bytes, handle, address, descs
            )
            infos = [control.parse(b) for b in all_gather(me.encode())]
            control.check_peers(infos, n, cfg.fingerprint(), cfg.nodes)
            bases = self._map_peers(infos)
            if self.proxy is not None:
                self.proxy.connect({r: infos[r].descs for r in self.proxy_peers})
            self._alloc(bases)
            all_gather(b"mapped")  # nobody stores into a peer before every rank is ready
        except BaseException:
            self._release()
            raise
        self._closed = False
        self._d_epoch = self._c_epoch = 0
        self._n_tok = -1

    # ---- setup ----

    def _map_peers(self, infos: list[control.PeerInfo]) -> list[int]:
        import cupy

        bases = [0] * self.cfg.world_size
        for r in self.nvlink_peers:
            if r == self.rank:
                bases[r] = self._staging
                continue
            info = infos[r]
            if len(info.ipc_handle) != control.IPC_HANDLE_LEN or info.staging_bytes != self.staging_bytes:
                raise control.ControlMessageError(f"rank {r} sent no usable staging buffer for NVLink")
            # cudaIpcMemLazyEnablePeerAccess
            ptr = int(cupy.cuda.runtime.ipcOpenMemHandle(info.ipc_handle, 1))
            self._opened.append(ptr)
            bases[r] = ptr
        return bases

    def _pointer_tables(self, bases: list[int]) -> np.ndarray[Any, np.dtype[np.int64]]:
        """Per call parity and peer, where the kernels store to and wait on (see _TABLES)."""
        n, me = self.cfg.world_size, self.rank
        tables = np.zeros((2, _TABLES, n), dtype=np.int64)
        px = self.proxy
        for p in range(2):
            for r in range(n):
                d_in = self._staging + (p * n + r) * self._dslot
                c_in = self._staging + self._comb_base + (p * n + r) * self._cslot
                if px is None or r not in self.proxy_peers:
                    b = bases[r]
                    tables[p, 0, r] = b + (p * n + me) * self._dslot
                    tables[p, 1, r] = b + self._flag_base + me * 8
                    tables[p, 2, r] = d_in
                    tables[p, 3, r] = self._staging + self._flag_base + r * 8
                    tables[p, 4, r] = b + self._comb_base + (p * n + me) * self._cslot
                    tables[p, 5, r] = b + self._flag_base + (n + me) * 8
                    tables[p, 6, r] = c_in
                    tables[p, 7, r] = self._staging + self._flag_base + (n + r) * 8
                else:
                    tables[p, 0, r] = px.dsend.dev + (p * n + r) * self._dslot
                    tables[p, 2, r] = px.drecv.dev + (p * n + r) * self._dslot
                    tables[p, 3, r] = px.flag_dev(0)
                    tables[p, 4, r] = px.csend.dev + (p * n + r) * self._cslot
                    tables[p, 6, r] = px.crecv.dev + (p * n + r) * self._cslot
                    tables[p, 7, r] = px.flag_dev(1)
        return tables

    def _alloc(self, bases: list[int]) -> None:
        torch = self._torch
        cfg, n, me = self.cfg, self.cfg.world_size, self.rank
        dev = torch.device("cuda", self.device)
        t, k, h = cfg.max_tokens, cfg.experts_per_token, cfg.hidden
        self._tables = torch.from_numpy(self._pointer_tables(bases)).to(dev)
        self._proxy_mask = sum(1 << r for r in self.proxy_peers)
        self._layout = torch.from_numpy(layout_words(cfg, me, self._lay)).to(dev)
        self._ctr = torch.zeros(4, dtype=torch.int32, device=dev)
        self._err = torch.zeros(1, dtype=torch.int32, device=dev)
        self._slot_of = torch.full((t, n), -1, dtype=torch.int32, device=dev)
        self._pos = torch.full((n * t * k,), -1, dtype=torch.int32, device=dev)
        self._wts = torch.zeros(n * t * k, dtype=torch.float32, device=dev)
        self._ntok = torch.zeros(n, dtype=torch.int32, device=dev)
        self._counts = torch.zeros(cfg.experts_per_rank, dtype=torch.int32, device=dev)
        self._offsets = torch.zeros(cfg.experts_per_rank + 1, dtype=torch.int32, device=dev)
        cap = cfg.expert_capacity
        if cfg.in_dtype == "fp8":
            self._x_out = torch.zeros((cap, h), dtype=torch.float8_e4m3fn, device=dev)
            self._s_out: Tensor | None = torch.zeros(
                (cap, cfg.scales_per_token), dtype=torch.float32, device=dev
            )
        else:
            self._x_out = torch.zeros((cap, h), dtype=torch.bfloat16, device=dev)
            self._s_out = None
        self.out_dtype = torch.float32 if cfg.out_dtype == "fp32" else torch.bfloat16
        self._out: Tensor = torch.zeros((t, h), dtype=self.out_dtype, device=dev)
        self._in_dtype = torch.float8_e4m3fn if cfg.in_dtype == "fp8" else torch.bfloat16
        self._result = DispatchResult(self._x_out, self._s_out, self._counts, self._offsets)
        px = self.proxy
        self._watchers = (px.w_dispatch.device_ptr, px.w_combine.device_ptr) if px is not None else (0, 0)
        u64 = np.uint64
        tab: int = self._tables.data_ptr()
        self._tab = [[u64(tab + ((p * _TABLES + w) * n) * 8) for w in range(_TABLES)] for p in range(2)]
        ptr = {name: u64(getattr(self, name).data_ptr()) for name in _SCRATCH}
        self._p = ptr
        self._p["_ctr_c"] = u64(int(ptr["_ctr"]) + 8)
        self._p["_s_out"] = u64(0 if self._s_out is None else self._s_out.data_ptr())
        self._consts = (u64(self._proxy_mask), u64(self._watchers[0]), u64(self._watchers[1]))
        lay = self._lay
        k_ = self._k
        self._grid_copy = k_.copy_blocks(n * t * ((lay.seg_x >> 4) + (lay.seg_scales >> 2)))
        self._grid_csend = k_.copy_blocks(n * t * (h * cfg.out_itemsize // 16))
        self._chunks_out = h * cfg.out_itemsize // 16

    # ---- checks ----

    def _check_tensor(
        self, name: str, t: Any, shape: tuple[int, ...], dtypes: tuple[Any, ...], *, rows_ok: bool = False
    ) -> None:
        torch = self._torch
        if not isinstance(t, torch.Tensor):
            raise InvalidArgument(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cuda" or t.device.index != self.device:
            raise InvalidArgument(f"{name} is on {t.device}, this AllToAll runs on cuda:{self.device}")
        if t.dtype not in dtypes:
            raise InvalidArgument(f"{name} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
        if tuple(t.shape) != shape:
            raise InvalidArgument(f"{name} has shape {tuple(t.shape)}, expected {shape}")
        if t.numel() and not (t.stride(-1) == 1 and (rows_ok or t.is_contiguous())):
            raise InvalidArgument(f"{name} must be contiguous")

    def _live(self) -> None:
        if self._closed:
            raise EngineClosed("this AllToAll is closed")

    # ---- the calls ----

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        scales: torch.Tensor | None = None,
    ) -> DispatchResult:
        """Send each of this rank's ``n`` tokens (``x``: ``[n, hidden]``, ``n`` up to
        ``max_tokens``; fp8 with ``scales``: ``[n, hidden / scale_block]`` fp32) to the
        ranks of its experts (``topk_idx``: ``[n, k]`` int32/int64, distinct per token; a
        negative id means no expert) and return the tokens for this rank's experts."""
        self._live()
        torch = self._torch
        cfg = self.cfg
        n = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
        if not 0 <= n <= cfg.max_tokens:
            raise InvalidArgument(f"x must be [n, {cfg.hidden}] with n <= max_tokens={cfg.max_tokens}")
        self._check_tensor("x", x, (n, cfg.hidden), (self._in_dtype,), rows_ok=True)
        k = cfg.experts_per_token
        self._check_tensor("topk_idx", topk_idx, (n, k), (torch.int32, torch.int64))
        self._check_tensor("topk_weights", topk_weights, (n, k), (torch.float32,))
        if cfg.in_dtype == "fp8":
            if scales is None:
                raise InvalidArgument("fp8 dispatch needs scales [n, hidden / scale_block] (float32)")
            self._check_tensor("scales", scales, (n, cfg.scales_per_token), (torch.float32,), rows_ok=True)
            s_ptr, s_stride = scales.data_ptr(), scales.stride(0) * 4
        else:
            if scales is not None:
                raise InvalidArgument("scales are for fp8 input only")
            s_ptr, s_stride = 0, 0
        x_stride = x.stride(0) * x.element_size()
        if n and (x.data_ptr() % 16 or x_stride % 16):
            raise InvalidArgument("x rows must start on 16-byte boundaries")
        self._d_epoch += 1
        epoch = self._d_epoch
        p = epoch & 1
        if self.proxy is not None:
            self.proxy.arm_dispatch(epoch)
        k_, ptr, tab = self._k, self._p, self._tab[p]
        u64 = np.uint64
        stream = k_.stream(torch.cuda.current_stream(self.device).cuda_stream)
        with stream:
            k_.fn["dispatch_send"](
                (max(1, min(2 * k_.sms, n)),), (k_.send_threads,),
                (
                    u64(topk_idx.data_ptr()), np.int32(topk_idx.dtype == torch.int64),
                    u64(topk_weights.data_ptr()), u64(x.data_ptr()), np.int64(x_stride),
                    u64(s_ptr), np.int64(s_stride), np.int32(n), ptr["_layout"], tab[0], tab[1],
                    self._consts[0], self._consts[1], u64(epoch), ptr["_slot_of"], ptr["_ctr"], ptr["_err"],
                ),
                shared_mem=k_.send_smem,
            )  # fmt: skip
            k_.fn["dispatch_route"](
                (1,), (ROUTE_THREADS,),
                (
                    tab[2], tab[3], u64(epoch), ptr["_layout"], np.int64(cfg.expert_capacity),
                    ptr["_counts"], ptr["_offsets"], ptr["_pos"], ptr["_wts"], ptr["_ntok"], ptr["_err"],
                    u64(self._timeout_ns),
                ),
                shared_mem=k_.route_smem,
            )  # fmt: skip
            k_.fn["dispatch_copy"](
                (self._grid_copy,),
                (COPY_THREADS,),
                (tab[2], ptr["_ntok"], ptr["_pos"], ptr["_layout"], ptr["_x_out"], ptr["_s_out"]),
            )
        self._n_tok = n
        return self._result

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """For each token of the last dispatch, the sum over its experts of routing weight
        times that expert's output. ``expert_out``: ``[expert_capacity, hidden]`` in the
        output dtype, rows laid out as dispatch returned them. Returns ``[n, hidden]``
        (a view valid until the next combine)."""
        self._live()
        if self._n_tok < 0:
            raise UsageError("combine before any dispatch")
        cfg = self.cfg
        torch = self._torch
        self._check_tensor("expert_out", expert_out, (cfg.expert_capacity, cfg.hidden), (self.out_dtype,))
        self._c_epoch += 1
        epoch = self._c_epoch
        p = epoch & 1
        if self.proxy is not None:
            self.proxy.arm_combine(epoch)
        k_, ptr, tab = self._k, self._p, self._tab[p]
        u64 = np.uint64
        stream = k_.stream(torch.cuda.current_stream(self.device).cuda_stream)
        n = self._n_tok
        with stream:
            k_.fn["combine_send"](
                (self._grid_csend,), (COPY_THREADS,),
                (
                    u64(expert_out.data_ptr()), ptr["_pos"], ptr["_wts"], ptr["_ntok"],
                    np.int32(cfg.hidden), ptr["_layout"], tab[4], tab[5], self._consts[0],
                    self._consts[2], u64(epoch), ptr["_ctr_c"],
                ),
            )  # fmt: skip
            k_.fn["combine_recv"](
                (k_.copy_blocks(n * self._chunks_out),), (COPY_THREADS,),
                (
                    tab[6], tab[7], u64(epoch), ptr["_slot_of"], np.int32(n), np.int32(cfg.hidden),
                    ptr["_layout"], ptr["_out"], ptr["_err"], u64(self._timeout_ns),
                ),
            )  # fmt: skip
        return self._out[:n]

    def check(self) -> None:
        """Wait for this rank's calls so far and raise what the kernels flagged: a peer
        that did not publish in time, expert ids out of range, or overflow."""
        self._live()
        self._torch.cuda.current_stream(self.device).synchronize()
        if self.proxy is not None:
            self.proxy.raise_errors()
        err = int(self._err.item())
        if not err:
            return
        self._err.zero_()
        if err & ERR_TIMEOUT:
            raise OperationTimeout(
                f"MoE all-to-all on rank {self.rank}: a peer did not publish its data in time"
            )
        if err & ERR_EXPERT:
            raise InvalidArgument(
                f"topk_idx held expert ids >= num_experts ({self.cfg.num_experts}); they were ignored"
            )
        if err & ERR_CAPACITY:
            raise InvalidArgument(
                "more (token, expert) entries than expert_capacity: are top-k ids distinct?"
            )

    # ---- lifetime ----

    def close(self) -> None:
        """Collective: wait for this rank's work, let every rank reach close (so no peer
        still stores into this rank's buffers), then release everything."""
        if self._closed:
            return
        self._closed = True
        self._torch.cuda.synchronize(self.device)
        try:
            self._gather(b"close")
        finally:
            self._release()

    def _release(self) -> None:
        import cupy

        rt = cupy.cuda.runtime
        if self.proxy is not None:
            self.proxy.close()
            self.proxy = None
        for ptr in self._opened:
            rt.ipcCloseMemHandle(ptr)
        self._opened = []
        if self._staging:
            rt.free(self._staging)
            self._staging = 0

    def __enter__(self) -> AllToAll:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"AllToAll(rank {self.rank}/{c.world_size}, {c.num_experts} experts top-{c.experts_per_token}, "
            f"hidden {c.hidden} {c.in_dtype}->{c.out_dtype}, path {self.path}"
            f"{', closed' if self._closed else ''})"
        )
