"""bf16 -> fp8 (e4m3) with one float32 scale per block x block tile, DeepSeek-V3's format:
``weight ≈ fp8.float() * scale`` where ``scale = amax(|tile|) / 448``."""

from __future__ import annotations

from typing import Any

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max


def quantize_blocks(w: Any, block: int) -> tuple[Any, Any]:
    """``(fp8 tensor of w's shape, float32 scales [ceil(r/block), ceil(c/block)])`` for a
    2-d tensor, on w's device. An all-zero tile gets scale 1 (and zeros)."""
    import torch

    rows, cols = w.shape
    br, bc = -(-rows // block), -(-cols // block)
    x = w.float()
    pad = torch.nn.functional.pad(x, (0, bc * block - cols, 0, br * block - rows))
    tiles = pad.view(br, block, bc, block)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    data = q.view(br * block, bc * block)[:rows, :cols].to(torch.float8_e4m3fn)
    return data.contiguous(), scale.contiguous()


def dequantize_blocks(data: Any, scale: Any, block: int) -> Any:
    """The float32 tensor an fp8 tensor and its tile scales stand for."""
    rows, cols = data.shape
    full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return data.float() * full
