"""Moving one layer's KV between a model's ``[part, head, token, dim]`` tensors and a paged
cache shaped ``layout.shape()`` — numpy arrays or torch tensors (CPU or CUDA) alike.

The model's natural order for a layer is already heads before tokens, so storing a
request's tokens into a contiguous run of pages is two slice assignments (the full pages,
then the partial last one), no transpose.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def store_layer(cache: Any, layer: int, first_page: int, kv: Any) -> None:
    """Write ``kv`` (``[parts, heads, tokens, dim]``) into pages ``first_page ...`` of
    ``cache[layer]`` (``cache`` shaped ``(layers, parts, heads, pages, tokens_per_page, dim)``)."""
    parts, heads, tokens, dim = kv.shape
    tpp = cache.shape[4]
    full, rem = divmod(tokens, tpp)
    if full:
        cache[layer, :, :, first_page : first_page + full] = kv[:, :, : full * tpp].reshape(
            parts, heads, full, tpp, dim
        )
    if rem:
        cache[layer, :, :, first_page + full, :rem] = kv[:, :, full * tpp :]


def gather_layer(cache: Any, layer: int, pages: npt.NDArray[np.int64], tokens: int) -> Any:
    """Read a request's ``tokens`` back from its ``pages`` (prompt order) of ``cache[layer]``:
    ``[parts, heads, tokens, dim]``."""
    idx: Any = pages
    if type(cache).__module__.split(".")[0] == "torch":
        import torch

        idx = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=cache.device)
    x = cache[layer][:, :, idx]  # (parts, heads, n, tpp, dim)
    parts, heads, n, tpp, dim = x.shape
    return x.reshape(parts, heads, n * tpp, dim)[:, :, :tokens]
