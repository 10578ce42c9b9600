"""``AllToAll``: MoE dispatch and combine between ranks (one process per GPU).

Each rank allocates one staging buffer in GPU memory (per source and call parity: a
dispatch slot and a combine slot, plus epoch flags) and hands its CUDA IPC handle to the
ranks on its node, which map it and store into it directly over NVLink. Ranks on other
nodes (or every other rank with ``path="proxy"``) go through the host proxy
(:mod:`afabric.moe.proxy`). Calls are stream-ordered on torch's current stream and never
synchronize with the host: they return once the kernels are enqueued. The call counter
(epoch) and the slot parity live on the device, so on the NVLink path a call captured into
a CUDA graph (``torch.cuda.graph``) replays correctly, interleaved with eager calls.

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
from .kernels import (
    COPY_THREADS,
    ERR_CAPACITY,
    ERR_EXPERT,
    ERR_TIMEOUT,
    ROUTE_THREADS,
    Kernels,
    Launch,
    layout_words,
)

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from .proxy import Proxy

AllGather = Callable[[bytes], Sequence[bytes]]
"""Collective: every rank passes its bytes and gets every rank's, in rank order."""

PATHS = ("auto", "nvlink", "proxy")
# Up to this many (token, expert) entries per call in all (world * max_tokens * top-k),
# dispatch is one kernel that sends, then receives with every block counting every entry
# (decode); above it, a send kernel, a routing kernel that counts once for all and a copy
# kernel (prefill).
FUSED_RECEIVE_MAX_ENTRIES = 4096
_TABLES = 8  # dispatch dst slot/flag, src slot/flag; combine the same
_SCRATCH = (
    "_layout",
    "_ctr",
    "_epochs",
    "_err",
    "_slot_of",
    "_tok_of",
    "_gcount",
    "_cursor",
    "_fill",
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

    Collective: every rank constructs it with the same ``MoeConfig``, then calls ``dispatch``
    and ``combine`` the same number of times, in the same order, and finally ``close``.

    Args:
        config: the layer's shape, identical on every rank.
        rank: this rank (0..world_size-1).
        all_gather: exchanges a bytes object with every rank (setup and close only), e.g.
            ``torch_all_gather()``.
        device: the CUDA device (default: the current one).
        path: ``"auto"`` (NVLink within a node, the host proxy across), ``"nvlink"`` or
            ``"proxy"``.
        provider: the proxy engine's provider (default: a default engine, which routes: cma
            to ranks of this host, the network provider to the others).
        bind: the interface address the proxy engine's network transport binds (tcp binds
            127.0.0.1 unless given one: ranks on other nodes need it).
        tag: the message tag of the proxy's control messages.
        timeout: seconds after which kernels waiting for a peer give up.

    Raises:
        InvalidArgument: a bad argument, or ``path="nvlink"`` with ranks on several nodes.
        ControlMessageError: a peer's setup message is malformed or unusable.
    """

    def __init__(
        self,
        config: MoeConfig,
        *,
        rank: int,
        all_gather: AllGather,
        device: int | None = None,
        path: str = "auto",
        provider: str = "auto",
        bind: str | None = None,
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

                self.proxy = Proxy(cfg, rank, self.proxy_peers, provider, tag, self.device, bind)
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
        self._ctr = torch.zeros(8, dtype=torch.int32, device=dev)  # send 0-1, combine 2-3, route 4
        self._epochs = torch.zeros(2, dtype=torch.int64, device=dev)  # last dispatch, last combine
        self._err = torch.zeros(1, dtype=torch.int32, device=dev)
        self._slot_of = torch.full((t, n), -1, dtype=torch.int32, device=dev)
        self._tok_of = torch.zeros(t, dtype=torch.int32, device=dev)
        self._gcount = torch.zeros(cfg.experts_per_rank, dtype=torch.int32, device=dev)
        self._cursor = torch.zeros(cfg.experts_per_rank, dtype=torch.int32, device=dev)
        self._fill = torch.zeros(2 * cfg.experts_per_rank, dtype=torch.int32, device=dev)
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
        self._in_dtypes = (torch.float8_e4m3fn if cfg.in_dtype == "fp8" else torch.bfloat16,)
        self._idx_dtypes = (torch.int32, torch.int64)
        self._int64 = torch.int64
        self._f32 = (torch.float32,)
        self._out_dtypes = (self.out_dtype,)
        self._result = DispatchResult(self._x_out, self._s_out, self._counts, self._offsets)
        px = self.proxy
        self._watchers = (px.w_dispatch.device_ptr, px.w_combine.device_ptr) if px is not None else (0, 0)
        self._launches()

    def _launches(self) -> None:
        """Argument blocks, in kernels.cu's parameter order (0 marks a word set per call),
        and grid sizes."""
        torch, cfg, n = self._torch, self.cfg, self.cfg.world_size
        t, k, h = cfg.max_tokens, cfg.experts_per_token, cfg.hidden
        tab: int = self._tables.data_ptr()
        ptr = {name: int(getattr(self, name).data_ptr()) for name in _SCRATCH}
        ep = ptr["_epochs"]
        s_out = 0 if self._s_out is None else self._s_out.data_ptr()
        k_, cap = self._k, cfg.expert_capacity
        lo, mask, tmo = ptr["_layout"], self._proxy_mask, self._timeout_ns
        fn = k_.fn
        # Arguments by the kernels' parameter names (kernels.cu); 0 marks the words a call sets.
        per_call = dict.fromkeys(
            ("topk", "idx64", "weights", "x", "x_stride", "scales", "s_stride", "n_tok"), 0
        )
        sender = dict(Lp=lo, tab=tab, ep=ep, proxy_mask=mask, watcher=self._watchers[0],
                      slot_of=ptr["_slot_of"], tok_of=ptr["_tok_of"], ctr=ptr["_ctr"],
                      err=ptr["_err"])  # fmt: skip
        self._send = Launch(fn["dispatch_send"], "dispatch_send", k_.send_threads, k_.send_smem)
        self._send.set(**per_call, **sender)
        self._route = Launch(fn["dispatch_route"], "dispatch_route", ROUTE_THREADS, k_.route_smem)
        self._route.set(tab=tab, ep=ep, Lp=lo, capacity=cap, expert_counts=ptr["_counts"],
                        expert_offsets=ptr["_offsets"], gcount=ptr["_gcount"], cursor=ptr["_cursor"],
                        ntok=ptr["_ntok"], ctr=ptr["_ctr"] + 16, err=ptr["_err"], timeout_ns=tmo)  # fmt: skip
        self._copy = Launch(fn["dispatch_copy"], "dispatch_copy", COPY_THREADS)
        self._copy.set(tab=tab, ep=ep, ntok=ptr["_ntok"], cursor=ptr["_cursor"], Lp=lo, capacity=cap,
                       pos=ptr["_pos"], wts=ptr["_wts"], out_x=ptr["_x_out"], out_s=s_out,
                       x=0, x_stride=0, scales=0, s_stride=0, tok_of=ptr["_tok_of"])  # fmt: skip
        self._small = Launch(fn["dispatch_small"], "dispatch_small", k_.small_threads, k_.small_smem)
        self._small.set(**per_call, **sender, capacity=cap, expert_counts=ptr["_counts"],
                        expert_offsets=ptr["_offsets"], fill=ptr["_fill"], ntok=ptr["_ntok"], timeout_ns=tmo,
                        pos=ptr["_pos"], wts=ptr["_wts"], out_x=ptr["_x_out"], out_s=s_out)  # fmt: skip
        for a in (self._send, self._small):
            a.call_words = a.span("topk", "n_tok")
        self._copy.call_words = self._copy.span("x", "s_stride")
        self.fused_receive = n * t * k <= FUSED_RECEIVE_MAX_ENTRIES
        self._csend = Launch(fn["combine_send"], "combine_send", COPY_THREADS)
        self._csend.set(expert_out=0, pos=ptr["_pos"], wts=ptr["_wts"], ntok=ptr["_ntok"], H=h, Lp=lo,
                        tab=tab, ep=ep, proxy_mask=mask, watcher=self._watchers[1],
                        ctr=ptr["_ctr"] + 8)  # fmt: skip
        self._crecv = Launch(fn["combine_recv"], "combine_recv", COPY_THREADS)
        self._crecv.set(tab=tab, ep=ep, slot_of=ptr["_slot_of"], n_tok=0, H=h, Lp=lo, out=ptr["_out"],
                        err=ptr["_err"], timeout_ns=tmo)  # fmt: skip
        self._csend.call_words = self._csend.span("expert_out", "expert_out")
        self._crecv.call_words = self._crecv.span("n_tok", "n_tok")
        self._grid_send = [max(1, min(2 * k_.sms, m)) for m in range(t + 1)]
        self._grid_route = max(1, min(k_.sms, -(-n * t * k // ROUTE_THREADS)))
        self._grid_copy = max(1, min(k_.sms * 8, n * t))
        self._grid_small = max(1, min(k_.small_resident, k_.sms * 2, n * t))
        self._grid_csend = k_.copy_blocks(n * t * (h * cfg.out_itemsize // 16))
        self._chunks_out = h * cfg.out_itemsize // 16
        self._grid_crecv = [k_.copy_blocks(m * self._chunks_out) for m in range(t + 1)]
        get_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        dev_i = self.device
        self._stream: Callable[[], int] = (
            (lambda: int(get_raw(dev_i)))
            if get_raw is not None
            else (lambda: int(torch.cuda.current_stream(dev_i).cuda_stream))
        )

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

    def _fast_ok(self, t: Any, shape: tuple[int, ...], dtypes: tuple[Any, ...]) -> bool:
        """The common case in one expression (a call's checks cost well under a microsecond
        each); anything else goes through :meth:`_check_tensor` for the precise error."""
        return (
            isinstance(t, self._torch.Tensor)
            and t.get_device() == self.device
            and t.dtype in dtypes
            and t.shape == shape
            and t.is_contiguous()
        )

    def _not_capturing(self) -> None:
        """The proxy is armed from the host per call: a replayed graph would skip that."""
        if self._torch.cuda.is_current_stream_capturing():
            raise UsageError(
                "calls through the host proxy cannot be captured into a CUDA graph (NVLink calls can)"
            )

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
        """Send each token to the ranks of its experts; return the tokens for this rank's experts.

        On the NVLink path dispatch and combine can be captured into a CUDA graph
        (``torch.cuda.graph``); a replay sends the tensors and token count of the capture and may
        be interleaved with eager calls.

        Args:
            x: ``[n, hidden]`` tokens, ``n`` up to ``max_tokens`` (bf16, or fp8 e4m3).
            topk_idx: ``[n, k]`` int32/int64 expert ids, distinct per token; negative: no expert.
            topk_weights: ``[n, k]`` routing weights.
            scales: for fp8, ``[n, hidden / scale_block]`` fp32.

        Returns:
            Expert-major tokens: ``x``, ``scales``, ``expert_counts``, ``expert_offsets``.

        Raises:
            InvalidArgument: a tensor of the wrong device, dtype, shape or layout.
            UsageError: capturing on the host-proxy path.
            EngineClosed: this AllToAll is closed.
        """
        n, x_ptr, x_stride, s_ptr, s_stride = self._dispatch_args(x, topk_idx, topk_weights, scales)
        if self.proxy is not None:
            self._not_capturing()
            self._d_epoch += 1
            self.proxy.arm_dispatch(self._d_epoch)
        stream = self._stream()
        launch = self._small if self.fused_receive else self._send
        launch.words[launch.call_words] = (
            topk_idx.data_ptr(), topk_idx.dtype is self._int64, topk_weights.data_ptr(),
            x_ptr, x_stride, s_ptr, s_stride, n,
        )  # fmt: skip
        self._n_tok = n
        if self.fused_receive:
            self._small(self._grid_small, stream)
            return self._result
        self._send(self._grid_send[n], stream)
        self._route(self._grid_route, stream)
        self._copy.words[self._copy.call_words] = (x_ptr, x_stride, s_ptr, s_stride)
        self._copy(self._grid_copy, stream)
        return self._result

    def _dispatch_args(
        self, x: Any, topk_idx: Any, topk_weights: Any, scales: Any
    ) -> tuple[int, int, int, int, int]:
        """Checks dispatch's arguments; returns n and the row pointers and strides."""
        if self._closed:
            raise EngineClosed("this AllToAll is closed")
        torch = self._torch
        cfg = self.cfg
        n = int(x.shape[0]) if isinstance(x, torch.Tensor) and x.dim() == 2 else -1
        if not 0 <= n <= cfg.max_tokens:
            raise InvalidArgument(f"x must be [n, {cfg.hidden}] with n <= max_tokens={cfg.max_tokens}")
        k = cfg.experts_per_token
        xs = (n, cfg.hidden)
        if not self._fast_ok(x, xs, self._in_dtypes):
            self._check_tensor("x", x, xs, self._in_dtypes, rows_ok=True)
        if not self._fast_ok(topk_idx, (n, k), self._idx_dtypes):
            self._check_tensor("topk_idx", topk_idx, (n, k), self._idx_dtypes)
        if not self._fast_ok(topk_weights, (n, k), self._f32):
            self._check_tensor("topk_weights", topk_weights, (n, k), self._f32)
        if cfg.in_dtype == "fp8":
            if scales is None:
                raise InvalidArgument("fp8 dispatch needs scales [n, hidden / scale_block] (float32)")
            ss = (n, cfg.scales_per_token)
            if not self._fast_ok(scales, ss, self._f32):
                self._check_tensor("scales", scales, ss, self._f32, rows_ok=True)
            s_ptr, s_stride = scales.data_ptr(), scales.stride(0) * 4
        else:
            if scales is not None:
                raise InvalidArgument("scales are for fp8 input only")
            s_ptr, s_stride = 0, 0
        x_ptr = x.data_ptr()
        x_stride = x.stride(0) * x.element_size()
        if n and (x_ptr % 16 or x_stride % 16):
            raise InvalidArgument("x rows must start on 16-byte boundaries")
        return n, x_ptr, x_stride, s_ptr, s_stride

    def combine(self, expert_out: torch.Tensor) -> torch.Tensor:
        """Each token of the last dispatch: its experts' outputs summed with the routing weights.

        Args:
            expert_out: ``[expert_capacity, hidden]`` in the output dtype, rows laid out as
                dispatch returned them.

        Returns:
            ``[n, hidden]``: a view valid until the next combine.
        """
        self._live()
        if self._n_tok < 0:
            raise UsageError("combine before any dispatch")
        cfg = self.cfg
        shape = (cfg.expert_capacity, cfg.hidden)
        if not self._fast_ok(expert_out, shape, self._out_dtypes):
            self._check_tensor("expert_out", expert_out, shape, self._out_dtypes)
        if self.proxy is not None:
            self._not_capturing()
            self._c_epoch += 1
            self.proxy.arm_combine(self._c_epoch)
        stream = self._stream()
        self._csend.words[self._csend.call_words] = expert_out.data_ptr()
        self._csend(self._grid_csend, stream)
        n = self._n_tok
        self._crecv.words[self._crecv.call_words] = n
        self._crecv(self._grid_crecv[n], stream)
        return self._out[:n]

    def check(self) -> None:
        """Wait for this rank's calls so far and raise what the kernels flagged.

        Raises:
            OperationTimeout: a peer did not publish in time.
            InvalidArgument: expert ids were out of range, or more (token, expert) entries
                came than ``expert_capacity`` holds.
        """
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
        """Collective: wait for this rank's work, let every rank reach close, release everything.

        Waiting for every rank means no peer still stores into this rank's buffers.
        """
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
