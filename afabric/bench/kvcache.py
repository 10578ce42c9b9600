"""`afabric bench kvcache`: is the KV transfer of disaggregated prefill hidden behind compute?

A prefill process (cuda:0 with ``--device cuda``) runs a transformer-shaped model — per
layer the Q/K/V and output projections and a gated MLP, real torch matmuls whose cost grows
with the prompt (no attention: it only adds compute, and would hide transfers better) —
storing each layer's K and V (``kv_heads`` x ``head_dim`` 128, 16-bit) into its staging cache
and bumping the layer clock; afabric.kvcache's armed paged writes move each layer into the
decoder's pages as soon as it is bumped. The decoder (this process; cuda:1) measures, per
prompt length, in the same run:

- ``local``: time to first token without disaggregation — the decoder runs the same
  prefill itself (compute and cache stores, no transfer): the baseline;
- ``disagg``: from submitting the request to the last page and the tail landing;
- ``transfer``: the same request with the model's compute skipped (every layer signalled
  at once): the transfer alone, back to back;

each in both transfer modes of ``afabric.kvcache`` (``--mode``): ``push`` (the prefiller's
writes, armed per layer, overlap the compute) and ``pull`` (the prefiller holds the computed
pages and the decoder reads them all after the last layer, as vLLM's NIXL connector does:
nothing overlaps, but the prefiller needs no access to the decoder's memory); it
reports the per-layer compute and transfer times, both TTFTs and their ratio, the
*exposed* transfer (decoder's completion minus the prefiller's end of compute, both on
CLOCK_MONOTONIC of one host), its share of the disaggregated TTFT (goal: under 5% at 32K
tokens) and the fraction of transfer time hidden behind compute. Pages are 32 KiB (128
tokens of one head: the paper's setting). Nothing is asserted; it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .. import host_buffer
from . import harness, report
from .loops import run as run_on_loop
from .progress import Progress
from .raw import shim_path

HELP = "disaggregated prefill: per-layer compute vs transfer, TTFT with and without, transfer hidden"
GOAL_EXPOSED_PCT = 5.0
GOAL_TOKENS = 32768
HEAD_DIM, TOKENS_PER_PAGE = 128, 128  # 16-bit: 32 KiB per head and page


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int

    def flops_per_token_layer(self) -> int:
        q = self.heads * HEAD_DIM
        kv = 2 * self.kv_heads * HEAD_DIM
        return 2 * (self.hidden * (q + kv) + q * self.hidden + 3 * self.hidden * self.ffn)


CPU_MODEL = ModelShape(layers=4, hidden=256, heads=4, kv_heads=2, ffn=512)
GPU_MODEL = ModelShape(layers=8, hidden=4096, heads=32, kv_heads=8, ffn=14336)  # Llama-3-8B's layer


@dataclass
class Row:
    tokens: int
    mode: str
    pages: int
    kv_bytes_per_layer: int
    compute_per_layer_ms: float = 0.0
    transfer_per_layer_ms: float = 0.0
    ttft_local_ms: float = 0.0
    ttft_disagg_ms: float = 0.0
    transfer_only_ms: float = 0.0
    exposed_ms: float = 0.0
    exposed_pct_of_ttft: float = 0.0
    hidden_fraction: float = 0.0
    transfer_gbps: float = 0.0
    disagg_over_local: float = 0.0
    samples: dict[str, list[float]] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    count = harness.positive_int  # an argparse type: a whole number >= 1
    p.add_argument(
        "--provider", default="auto", type=harness.provider_name,
        help=harness.PROVIDER_HELP + "; with --device cuda, 'auto' is nvlink (GPU memory on both sides)",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu",
        help="cpu, or cuda: prefill on cuda:0, decode on cuda:1",
    )  # fmt: skip
    p.add_argument(
        "--tokens", default=None, metavar="LIST", help="prompt lengths (default 4K,32K,128K; quick 1K,4K)"
    )
    p.add_argument(
        "--layers", type=count, default=None, metavar="N", help="model layers (default: 4 CPU, 8 GPU)"
    )
    p.add_argument(
        "--hidden", type=count, default=None, metavar="N", help="model width (default: 256 CPU, 4096 GPU)"
    )
    p.add_argument(
        "--max-write", type=count, default=None, metavar="BYTES",
        help="largest write the decoder asks for: runs of pages up to this many bytes per head "
        "(default: 2 MiB on CPU; 32 KiB, one page per write, with --device cuda)",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=count, default=None, metavar="N", help="runs per length and mode (default 3)"
    )
    p.add_argument(
        "--quick", action="store_true", help="1K and 4K tokens, 2 layers, one run each (smoke run)"
    )
    p.add_argument(
        "--mode", choices=("push", "pull", "both"), default="both",
        help="kvcache transfer mode: push (prefiller writes per layer), pull (decoder reads when all "
        "computed), or both (a row each; default)",
    )  # fmt: skip
    p.add_argument(
        "--hugepages", action="store_true",
        help="CPU caches over afabric.host_buffer (2 MiB-aligned, advised for transparent huge "
        "pages): same-host copies (cma) into them run faster",
    )  # fmt: skip
    p.add_argument("--json", metavar="PATH", default=None, help=harness.JSON_HELP)
    p.add_argument(
        "--loop", choices=("asyncio", "uvloop"), default=harness.default_loop(), help=harness.LOOP_HELP
    )


def _tokens(text: str) -> list[int]:
    out = []
    for item in text.split(","):
        t = item.strip().upper()
        out.append(int(t.rstrip("K")) * (1024 if t.endswith("K") else 1))
    if not out or min(out) < 1:
        raise ValueError(f"not a list of prompt lengths: {text!r}")
    return out


# ---- the model (torch is imported only when the benchmark runs) ----


class _Model:
    """One transformer layer's weights, applied ``layers`` times (compute per layer is what
    matters, not distinct weights)."""

    def __init__(self, shape: ModelShape, device: Any) -> None:
        import torch

        self.torch = torch
        self.shape = shape
        self.device = device
        self.dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        g = torch.Generator(device="cpu").manual_seed(0)
        q, kv = shape.heads * HEAD_DIM, 2 * shape.kv_heads * HEAD_DIM

        def w(i: int, o: int) -> Any:
            return (torch.randn(i, o, generator=g) / i**0.5).to(device=device, dtype=self.dtype)

        self.w_qkv, self.w_o = w(shape.hidden, q + kv), w(q, shape.hidden)
        self.w_gate, self.w_up, self.w_down = (
            w(shape.hidden, shape.ffn),
            w(shape.hidden, shape.ffn),
            w(shape.ffn, shape.hidden),
        )

    def embed(self, tokens: int) -> Any:
        """The prompt's embeddings (random, made on the device)."""
        x = self.torch.randn(tokens, self.shape.hidden, device=self.device, dtype=self.dtype)
        self.sync()
        return x

    def layer(self, x: Any) -> tuple[Any, Any]:
        """(next x, K and V as [2, kv_heads, tokens, head_dim] in 16 bits)."""
        t, s = self.torch, self.shape
        q_dim = s.heads * HEAD_DIM
        qkv = x @ self.w_qkv
        attn_out = qkv[:, :q_dim] @ self.w_o
        x = x + attn_out
        x = x + (t.nn.functional.silu(x @ self.w_gate) * (x @ self.w_up)) @ self.w_down
        kv = qkv[:, q_dim:].reshape(x.shape[0], 2, s.kv_heads, HEAD_DIM).permute(1, 2, 0, 3)
        return x, kv.to(t.bfloat16 if self.dtype == t.bfloat16 else t.float16)

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)


def _layout(shape: ModelShape, max_tokens: int, dtype: str) -> Any:
    from ..kvcache import KvCacheLayout

    return KvCacheLayout(
        num_layers=shape.layers, num_kv_heads=shape.kv_heads, head_dim=HEAD_DIM, dtype=dtype,
        tokens_per_page=TOKENS_PER_PAGE, num_pages=-(-max_tokens // TOKENS_PER_PAGE),
        tail_bytes=shape.hidden * 2, tail_slots=4,
    )  # fmt: skip


def _torch_dtype(device: str) -> str:
    return "bfloat16" if device == "cuda" else "float16"


# ---- the prefill process ----


def prefill_process(
    conn: Connection, provider: str, device: str, shape: ModelShape, max_tokens: int, loop: str,
    hugepages: bool = False,
) -> None:
    """Serves requests; each job's payload says ``compute`` or ``transfer`` (signal every
    layer at once); after each job it sends ``(t_begin, t_end, layer_times)``."""
    run_on_loop(_prefill(conn, provider, device, shape, max_tokens, hugepages), loop)


def _zeros(shape: tuple[int, ...], dtype: Any, dev: Any, hugepages: bool) -> Any:
    """A zeroed tensor; on the CPU with ``hugepages``, over afabric.host_buffer's memory."""
    import torch

    n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if not hugepages or dev.type != "cpu" or n == 0:
        return torch.zeros(shape, dtype=dtype, device=dev)
    return torch.frombuffer(host_buffer(n), dtype=dtype).view(shape)


async def _prefill(
    conn: Connection, provider: str, device: str, shape: ModelShape, max_tokens: int, hugepages: bool
) -> None:
    import torch

    from .. import Engine
    from ..kvcache import Prefiller, PrefillJob
    from ..kvcache.views import store_layer

    torch.set_num_threads(1)  # leave the other core(s) to the shim's threads and the decoder
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    model = _Model(shape, dev)
    lay = _layout(shape, max_tokens, _torch_dtype(device))
    kv_dtype = torch.bfloat16 if device == "cuda" else torch.float16
    async with Engine(provider) as eng:
        cache = _zeros(lay.shape(), kv_dtype, dev, hugepages)
        tail = _zeros((lay.tail_region_bytes,), torch.uint8, dev, hugepages)
        async with Prefiller(eng, lay, cache=cache, tail=tail, device=dev.index, peer_timeout=60.0) as pf:
            aloop = asyncio.get_running_loop()

            def work(job: PrefillJob) -> tuple[float, float, list[float]]:
                stamps: list[float] = []
                if job.payload == b"transfer":
                    t0 = time.monotonic()
                    for _ in range(shape.layers):
                        job.layer_done()
                    job.tail_done()
                    return t0, time.monotonic(), stamps
                x = model.embed(job.num_tokens)
                t0 = time.monotonic()
                for layer in range(shape.layers):
                    x, kv = model.layer(x)
                    store_layer(cache, layer, job.first_page, kv)
                    job.layer_done()
                    if device != "cuda":
                        stamps.append(time.monotonic())
                job.tail.view(kv_dtype).copy_(x[-1].to(kv_dtype))
                job.tail_done()
                model.sync()  # on a GPU: the kernels (and the bumps queued after them) ran
                return t0, time.monotonic(), stamps

            async def compute(job: PrefillJob) -> None:
                conn.send(await aloop.run_in_executor(None, work, job))

            server = asyncio.ensure_future(pf.serve(compute))
            conn.send(bytes(eng.address))
            await aloop.run_in_executor(None, conn.recv)  # stop
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)


# ---- the decoder: measurements ----


@contextlib.asynccontextmanager
async def _close_on_cancel(eng: Any, halt: threading.Event) -> AsyncIterator[None]:
    """Cancelled (the prefill process died, see harness.watch, or the user interrupted):
    stop the local prefill running in a thread at its next layer (a thread cannot be
    cancelled, and the loop waits for it) and close the engine at once, so that the decoder
    does not wait ``peer_timeout`` for the confirmations of a prefiller that is gone."""
    try:
        yield
    except asyncio.CancelledError:
        halt.set()
        await eng.aclose()
        raise


def _local_prefill(
    model: _Model, lay: Any, cache: Any, dec: Any, kv_dtype: Any, halt: threading.Event, tokens: int
) -> float:
    """The decoder computes the prefill itself (the baseline TTFT); runs in a thread, and
    stops at the next layer once ``halt`` is set."""
    from ..kvcache.views import store_layer

    pages = dec.allocator.alloc(lay.pages_for(tokens), contiguous=True)
    t0 = time.monotonic()  # the embeddings count, as they do in the disaggregated TTFT
    x = model.embed(tokens)
    for layer in range(model.shape.layers):
        if halt.is_set():
            raise RuntimeError("local prefill stopped: the benchmark was cancelled")
        x, kv = model.layer(x)
        store_layer(cache, layer, int(pages[0]), kv)
    last = x[-1].to(kv_dtype).clone()  # the tail, as the prefiller makes it
    model.sync()
    del last
    dt = time.monotonic() - t0
    dec.allocator.free(pages)
    return dt


async def _measure(
    args: argparse.Namespace, conn: Connection, prefiller: bytes, shape: ModelShape, bar: Progress
) -> tuple[list[Row], str]:
    import torch

    from .. import Address, Engine
    from ..kvcache import Decoder

    torch.set_num_threads(1)
    dev = torch.device("cuda:1" if args.device == "cuda" else "cpu")
    model = _Model(shape, dev)
    lay = _layout(shape, max(args.token_list), _torch_dtype(args.device))
    kv_dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
    aloop = asyncio.get_running_loop()
    rows: list[Row] = []
    halt = threading.Event()
    async with Engine(args.provider) as eng:
        fabric = eng.fabric_provider
        cache = _zeros(lay.shape(), kv_dtype, dev, args.hugepages)
        tail = _zeros((lay.tail_region_bytes,), torch.uint8, dev, args.hugepages)
        async with Decoder(
            eng, lay, cache=cache, tail=tail, peer_timeout=60.0, max_write=args.max_write
        ) as dec, _close_on_cancel(eng, halt):
            peer = Address.from_bytes(prefiller)

            async def remote(tokens: int, what: bytes, mode: str = "push") -> tuple[float, float, float]:
                """(TTFT, exposed: landed - prefiller's end of compute, prefiller's compute)."""
                t0 = time.monotonic()
                r = await dec.submit(peer, tokens, payload=what, mode=mode)
                await r.wait(timeout=600)
                t1 = time.monotonic()
                r.release()
                tb, te, _stamps = await aloop.run_in_executor(None, conn.recv)
                return t1 - t0, t1 - te, te - tb

            def local(tokens: int) -> float:
                return _local_prefill(model, lay, cache, dec, kv_dtype, halt, tokens)

            for mode in args.modes:  # warm up: connections, kernels
                await remote(min(args.token_list), b"compute", mode)
            await aloop.run_in_executor(None, local, min(args.token_list))
            for tokens in args.token_list:
                kvb = 2 * shape.kv_heads * tokens * HEAD_DIM * 2
                s: dict[str, dict[str, list[float]]] = {
                    m: {k: [] for k in ("local", "disagg", "transfer", "exposed", "compute")}
                    for m in args.modes
                }
                for rep in range(args.repeat):
                    bar.step(f"{tokens} tokens, run {rep + 1}/{args.repeat}")
                    base = await aloop.run_in_executor(None, local, tokens)  # one baseline for all modes
                    for mode in args.modes:
                        s[mode]["local"].append(base)
                        ttft, exposed, busy = await remote(tokens, b"compute", mode)
                        s[mode]["disagg"].append(ttft)
                        s[mode]["exposed"].append(max(0.0, exposed))
                        s[mode]["compute"].append(busy)
                        s[mode]["transfer"].append((await remote(tokens, b"transfer", mode))[0])
                    bar.advance()
                for mode in args.modes:
                    row = Row(tokens, mode, lay.pages_for(tokens), kvb)
                    rows.append(_summarize(row, shape.layers, s[mode]))
    return rows, fabric


def _summarize(row: Row, layers: int, s: dict[str, list[float]]) -> Row:
    """Medians of the runs (seconds) into the row's milliseconds and ratios."""
    med = {k: statistics.median(v) for k, v in s.items()}
    row.compute_per_layer_ms = med["compute"] / layers * 1e3
    row.transfer_per_layer_ms = med["transfer"] / layers * 1e3
    row.ttft_local_ms = med["local"] * 1e3
    row.ttft_disagg_ms = med["disagg"] * 1e3
    row.transfer_only_ms = med["transfer"] * 1e3
    row.exposed_ms = med["exposed"] * 1e3
    row.exposed_pct_of_ttft = 100.0 * med["exposed"] / med["disagg"] if med["disagg"] else 0.0
    row.hidden_fraction = max(0.0, 1.0 - med["exposed"] / med["transfer"]) if med["transfer"] else 0.0
    row.transfer_gbps = row.kv_bytes_per_layer * layers / med["transfer"] / 1e9 if med["transfer"] else 0.0
    row.disagg_over_local = med["disagg"] / med["local"] if med["local"] else 0.0
    row.samples = {k: [x * 1e3 for x in v] for k, v in s.items()}
    return row


def render(rows: list[Row], header: str) -> str:
    out = [header, ""]
    out.append(
        f"{'tokens':>7} {'mode':>5} {'pages':>6} {'KV/layer':>9} {'compute/layer':>14} "
        f"{'transfer/layer':>15} {'TTFT local':>11} {'TTFT disagg':>12} {'disagg/local':>13} "
        f"{'exposed':>9} {'of TTFT':>8} "
        f"{'hidden':>7} {'GB/s':>7}"
    )
    for r in rows:
        out.append(
            f"{r.tokens:>7} {r.mode:>5} {r.pages:>6} {r.kv_bytes_per_layer / 2**20:>7.1f}Mi "
            f"{r.compute_per_layer_ms:>11.2f} ms "
            f"{r.transfer_per_layer_ms:>12.2f} ms {r.ttft_local_ms:>8.1f} ms {r.ttft_disagg_ms:>9.1f} ms "
            f"{r.disagg_over_local:>12.2f}x {r.exposed_ms:>6.1f} ms {r.exposed_pct_of_ttft:>7.1f}% "
            f"{100 * r.hidden_fraction:>6.1f}% {r.transfer_gbps:>7.2f}"
        )
    for g in [r for r in rows if r.tokens == GOAL_TOKENS]:
        met = "met" if g.exposed_pct_of_ttft < GOAL_EXPOSED_PCT else "NOT met"
        out.append(
            f"\ngoal ({g.mode}): exposed transfer under {GOAL_EXPOSED_PCT:g}% of TTFT at {GOAL_TOKENS} "
            f"tokens: {met} ({g.exposed_pct_of_ttft:.2f}%)"
        )
    return "\n".join(out)


def main(args: argparse.Namespace) -> int:
    harness.require("afabric bench kvcache", "torch")  # both processes need it: say so now
    report.check_outputs(args)
    quick = bool(getattr(args, "quick", False))
    device = getattr(args, "device", None) or "cpu"
    args.device = device
    requested = getattr(args, "provider", None) or "auto"
    if device == "cuda" and requested == "auto":
        args.provider, why = "nvlink", "using nvlink: --device cuda puts both caches in GPU memory"
    else:
        args.provider, why = harness.resolve_provider(requested)
    tokens = getattr(args, "tokens", None)
    args.token_list = _tokens(tokens) if tokens else ([1024, 4096] if quick else [4096, 32768, 131072])
    base = GPU_MODEL if device == "cuda" else CPU_MODEL
    layers = getattr(args, "layers", None) or (2 if quick else base.layers)
    hidden = getattr(args, "hidden", None) or base.hidden
    shape = ModelShape(layers, hidden, base.heads, base.kv_heads, max(base.ffn * hidden // base.hidden, 1))
    args.repeat = max(1, int(getattr(args, "repeat", None) or (1 if quick else 3)))
    mode = getattr(args, "mode", None) or "both"
    args.modes = ["push", "pull"] if mode == "both" else [mode]
    # one 32 KiB page per write on GPUs: the nvlink provider's copy kernel moves a page per
    # warp (many small units in parallel); larger writes are fewer work requests elsewhere
    args.max_write = getattr(args, "max_write", None) or (32 << 10 if device == "cuda" else 2 << 20)
    loop = getattr(args, "loop", None) or harness.default_loop()
    args.hugepages = bool(getattr(args, "hugepages", False))
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < 2:
            raise harness.CommandError("--device cuda needs two GPUs (prefill on cuda:0, decode on cuda:1)")
    child = harness.Child(
        "the benchmark's prefill process",
        prefill_process,
        (harness.PIPE, args.provider, device, shape, max(args.token_list), loop, args.hugepages),
    )

    async def run() -> tuple[list[Row], str]:
        async with harness.watch(child):  # a prefill process that dies fails the run at once
            addr = await child.arecv(300)
            with Progress(len(args.token_list) * args.repeat) as bar:  # a step: every mode once
                return await _measure(args, child.conn, addr, shape, bar)

    try:
        rows, fabric = run_on_loop(run(), loop)
    finally:
        child.stop("stop")
        child.close(60)
    where = (
        "prefill cuda:0 -> decode cuda:1" if device == "cuda" else "prefill and decode processes on the CPU"
    )
    header = (
        f"afabric bench kvcache — provider {args.provider} ({fabric}), {where}, loop {loop}, "
        f"{os.cpu_count()} cores, {platform.node()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n{why}\n"
        f"model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads / {shape.kv_heads} KV "
        f"heads x {HEAD_DIM}, ffn {shape.ffn} ({shape.flops_per_token_layer() / 1e6:.1f} MFLOP per token and "
        f"layer, no attention); 32 KiB pages ({TOKENS_PER_PAGE} tokens), writes up to {args.max_write} B; "
        f"medians of {args.repeat} run(s)\n"
        "TTFT local: the decoder computes the prefill itself (baseline, same run); TTFT disagg: submit -> "
        "every page and the tail landed; exposed: landed - end of compute; hidden: 1 - exposed / "
        "transfer alone\nmode push: the prefiller writes each layer as it is computed; pull: it holds "
        "the pages, the decoder reads them after the last layer (READY, reads, RELEASE)"
        + ("\nhuge pages: both caches over afabric.host_buffer" if args.hugepages else "")
    )
    print(render(rows, header))
    if getattr(args, "json", None):
        doc = {
            "bench": "kvcache",
            "command": report.command_line(args),
            "provider": args.provider,
            "fabric_provider": fabric,
            "device": device,
            "hugepages": args.hugepages,
            "loop": loop,
            "cpus": os.cpu_count(),
            "host": platform.node(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "shim": shim_path(),
            "model": asdict(shape),
            "page_bytes": TOKENS_PER_PAGE * HEAD_DIM * 2,
            "repeat": args.repeat,
            "max_write": args.max_write,
            "modes": args.modes,
            "rows": [asdict(r) for r in rows],
            "goal": {"exposed_pct_under": GOAL_EXPOSED_PCT, "tokens": GOAL_TOKENS},
        }
        report.write_outputs(doc, args)
    return 0
