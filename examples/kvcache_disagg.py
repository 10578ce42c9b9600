"""Disaggregated prefill with afabric.kvcache: a prefill process and a decode process.

The launcher starts both. The prefill process runs a small transformer (real attention
layers in torch) and serves requests: each layer's K and V go into its staging cache and
the layer is signalled with ``job.layer_done()``; the writes that move that layer into the
decoder's pages were armed beforehand and leave at once. The decode process sends several
concurrent prompts of different lengths, waits for their caches, checks that every page
is bit-identical to the KV it computes locally with the same weights, and decodes a few
tokens from the transferred cache.

    python examples/kvcache_disagg.py                      # CPU, tcp
    python examples/kvcache_disagg.py --provider shm
    python examples/kvcache_disagg.py --device cuda        # prefill on cuda:0, decode on cuda:1
                                                           # (provider nvlink unless given)
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import sys
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F  # noqa: N812

import afabric
from afabric.kvcache import Decoder, KvCacheLayout, Prefiller, PrefillJob
from afabric.kvcache.views import gather_layer, store_layer

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS, VOCAB = 128, 4, 2, 32, 4, 256
LENGTHS = [7, 100, 333, 64, 1000, 48]
DECODE_STEPS = 4


def layout(pages: int) -> KvCacheLayout:
    return KvCacheLayout(
        num_layers=LAYERS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="float32", tokens_per_page=16,
        num_pages=pages, tail_bytes=HIDDEN * 4, tail_slots=16,
    )  # fmt: skip


# ---- the model ----


def rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [heads, tokens, dim] at positions pos [tokens]."""
    half = x.shape[-1] // 2
    freq = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = pos.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=False)
        self.kv = nn.Linear(HIDDEN, 2 * KV_HEADS * HEAD_DIM, bias=False)
        self.o = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.up, self.down = nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN)

    def forward(
        self, x: torch.Tensor, pos: torch.Tensor, past: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [tokens, hidden] at positions pos; returns (x, k, v) with k, v [kv_heads,
        tokens, head_dim] of these tokens (K after RoPE: what the cache holds)."""
        t = x.shape[0]
        h = self.norm1(x)
        q = rope(self.q(h).view(t, HEADS, HEAD_DIM).transpose(0, 1), pos)
        k, v = self.kv(h).view(t, 2, KV_HEADS, HEAD_DIM).permute(1, 2, 0, 3)
        k = rope(k, pos)
        keys, values = (k, v) if past is None else (torch.cat([past[0], k], 1), torch.cat([past[1], v], 1))
        rep = HEADS // KV_HEADS
        att = F.scaled_dot_product_attention(
            q, keys.repeat_interleave(rep, 0), values.repeat_interleave(rep, 0), is_causal=past is None
        )
        x = x + self.o(att.transpose(0, 1).reshape(t, HEADS * HEAD_DIM))
        x = x + self.down(F.gelu(self.up(self.norm2(x))))
        return x, k.contiguous(), v.contiguous()


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)


def make_model(device: torch.device) -> Model:
    torch.set_num_threads(1)  # both processes compute alike: bit-identical on CPU too
    torch.manual_seed(0)  # and build the same weights
    return Model().to(device).eval()


@torch.inference_mode()
def prefill(model: Model, tokens: torch.Tensor, on_layer: Any) -> torch.Tensor:
    """Run the prompt; ``on_layer(i, k, v)`` after each layer; returns the last hidden state."""
    pos = torch.arange(tokens.shape[0], device=tokens.device)
    x: torch.Tensor = model.emb(tokens)
    for i, block in enumerate(model.blocks):
        x, k, v = block(x, pos)
        on_layer(i, k, v)
    return x[-1].contiguous()


@torch.inference_mode()
def decode(
    model: Model, past: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor, n: int
) -> list[int]:
    """Greedy tokens from a prompt's KV cache and last hidden state."""
    out: list[int] = []
    past = list(past)
    length = past[0][0].shape[1]
    for step in range(n):
        token = int(model.head(model.norm(last)).argmax())
        out.append(token)
        pos = torch.tensor([length + step], device=last.device)
        x = model.emb(torch.tensor([token], device=last.device))
        for i, block in enumerate(model.blocks):
            x, k, v = block(x, pos, past[i])
            past[i] = (torch.cat([past[i][0], k], 1), torch.cat([past[i][1], v], 1))
        last = x[-1]
    return out


def prompt(i: int, n: int) -> bytes:
    return np.random.default_rng(i).integers(0, VOCAB, n, dtype=np.uint8).tobytes()


# ---- the prefill process ----


async def prefill_main(conn: Connection, provider: str, device: str) -> None:
    dev = torch.device("cuda:0" if device == "cuda" else "cpu")
    model = make_model(dev)
    lay = layout(sum(-(-n // 16) for n in LENGTHS))
    async with afabric.Engine(provider) as eng:
        cache = torch.zeros(lay.shape(), dtype=torch.float32, device=dev)
        tail = torch.zeros(lay.tail_region_bytes, dtype=torch.uint8, device=dev)
        async with Prefiller(eng, lay, cache=cache, tail=tail, device=dev.index) as pf:
            loop = asyncio.get_running_loop()

            def work(job: PrefillJob) -> None:
                tokens = torch.tensor(list(job.payload), dtype=torch.long, device=dev)

                def layer(i: int, k: torch.Tensor, v: torch.Tensor) -> None:
                    store_layer(cache, i, job.first_page, torch.stack([k, v]))
                    job.layer_done()  # this layer's writes leave now (a kernel bump on CUDA)

                last = prefill(model, tokens, layer)
                job.tail.view(torch.float32).copy_(last)
                job.tail_done()

            async def compute(job: PrefillJob) -> None:
                await loop.run_in_executor(None, work, job)

            server = asyncio.ensure_future(pf.serve(compute))
            conn.send(bytes(eng.address))
            await loop.run_in_executor(None, conn.recv)  # "stop"
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
            print(f"prefill: served {pf.stats['done']} requests on {dev}", flush=True)


# ---- the decode process ----


async def decode_main(prefiller: bytes, provider: str, device: str) -> bool:
    dev = torch.device("cuda:1" if device == "cuda" else "cpu")
    model = make_model(dev)
    lay = layout(256)
    async with afabric.Engine(provider) as eng:
        cache = torch.zeros(lay.shape(), dtype=torch.float32, device=dev)
        tail = torch.zeros(lay.tail_region_bytes, dtype=torch.uint8, device=dev)
        # on GPUs one page per write: the nvlink provider copies a page per warp, in parallel
        max_write = lay.block_bytes if device == "cuda" else 2 << 20
        async with Decoder(eng, lay, cache=cache, tail=tail, max_write=max_write) as dec:
            peer = afabric.Address.from_bytes(prefiller)
            reqs = await asyncio.gather(
                *(dec.submit(peer, n, payload=prompt(i, n)) for i, n in enumerate(LENGTHS))
            )
            await asyncio.gather(*(r.wait(timeout=120) for r in reqs))
            ok = True
            for i, r in enumerate(reqs):
                tokens = torch.tensor(list(prompt(i, r.num_tokens)), dtype=torch.long, device=dev)
                local: list[tuple[torch.Tensor, torch.Tensor]] = []
                last = prefill(model, tokens, lambda _i, k, v, out=local: out.append((k, v)))
                got = [gather_layer(cache, layer, r.pages, r.num_tokens) for layer in range(LAYERS)]
                same_kv = all(
                    torch.equal(g[0], k) and torch.equal(g[1], v)
                    for g, (k, v) in zip(got, local, strict=True)
                )
                got_last = r.tail.view(torch.float32)
                same_tail = torch.equal(got_last, last)
                transferred = decode(model, [(g[0], g[1]) for g in got], got_last, DECODE_STEPS)
                reference = decode(model, local, last, DECODE_STEPS)
                ok &= same_kv and same_tail and transferred == reference
                verdict = "bit-identical" if same_kv else "DIFFERENT"
                print(
                    f"decode: request {r.request_id} ({r.num_tokens} tokens, {len(r.pages)} pages): "
                    f"KV cache {verdict} to the local prefill over {LAYERS} layers; last hidden state "
                    f"{'identical' if same_tail else 'DIFFERENT'}; next tokens {transferred}",
                    flush=True,
                )
                r.release()
            verdict = "all bit-identical" if ok else "MISMATCH"
            print(f"decode: {len(reqs)} concurrent requests on {dev}, {verdict}")
            return ok


def _run_prefill(conn: Connection, provider: str, device: str) -> None:
    asyncio.run(prefill_main(conn, provider, device))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--provider", default=None, help="tcp or shm on CPU (default tcp); nvlink on CUDA (default)"
    )
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = ap.parse_args()
    provider = args.provider or ("nvlink" if args.device == "cuda" else "tcp")
    if args.device == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
        if torch.cuda.device_count() < 2:
            print("--device cuda needs two GPUs (prefill on cuda:0, decode on cuda:1)", file=sys.stderr)
            return 2
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_run_prefill, args=(there, provider, args.device))
    proc.start()
    try:
        if not here.poll(120):
            print("prefill process did not start", file=sys.stderr)
            return 1
        ok = asyncio.run(decode_main(here.recv(), provider, args.device))
        here.send("stop")
        proc.join(60)
        return 0 if ok and proc.exitcode == 0 else 1
    finally:
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
