"""Registering CUDA memory (a torch tensor, a CuPy array) with the tcp provider: either it
works, and a write from it carries the right bytes into host memory, or it is refused with
a RegistrationError that says the provider cannot register CUDA memory. Distribution
builds of libfabric (Debian, Ubuntu) have no CUDA HMEM support, so refusal is expected
there; which of the two happened is printed.

Skipped, not faked, without a CUDA GPU or the library in question (failed instead where
AFABRIC_REQUIRE_GPU=1, as tests/gpu/run_device.sh sets on the GPU machine). Plain functions with
their own event loop (no pytest plugin needed); tests/gpu/run_device.sh runs them.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import pytest

import afabric
from afabric.errors import RegistrationError

PROVIDER = "tcp"
N = 1 << 16


def _unavailable(why: str) -> NoReturn:
    """Skip; fail where AFABRIC_REQUIRE_GPU=1 (tests/gpu/run_device.sh on the GPU machine)."""
    if os.environ.get("AFABRIC_REQUIRE_GPU") == "1":
        pytest.fail(f"AFABRIC_REQUIRE_GPU=1 but {why}")
    pytest.skip(why)


def _torch_cuda() -> Any:
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken CUDA install under torch
        _unavailable(f"torch is not usable here ({type(e).__name__}: {e})")
    if not torch.cuda.is_available():
        _unavailable("torch sees no CUDA GPU")
    return torch


def _cupy_gpu() -> Any:
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or CUDA libraries CuPy cannot load
        _unavailable(f"CuPy is not usable here ({type(e).__name__}: {e})")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver or no device
        _unavailable(f"no CUDA GPU ({type(e).__name__}: {e})")
    if count < 1:
        _unavailable("no CUDA GPU")
    return cupy


async def _register_and_write(buf: Any, expected: np.ndarray) -> str:
    """Register ``buf`` (CUDA memory on device 0) with one engine and write all of it into
    another engine's host region; or take the refusal. Returns which happened."""
    async with afabric.Engine(PROVIDER) as src, afabric.Engine(PROVIDER) as dst:
        host = np.zeros(N, dtype=np.uint8)
        hmr = dst.register(host)
        imm = dst.alloc_imm()
        try:
            mr = src.register(buf)
        except RegistrationError as e:
            msg = str(e)
            assert "cannot register CUDA memory" in msg, msg
            assert PROVIDER in msg, msg
            return f"refused: {msg}"
        assert mr.device == 0 and mr.length == N, mr
        await src.write(mr, hmr.descriptor, N, imm=imm)
        await dst.expect_imm(imm, 1, timeout=30)
        assert np.array_equal(host, expected), "the bytes written from CUDA memory differ"
        src.deregister(mr)
        return "registered; a write from it carried the right bytes to host memory"


def _check(label: str, make: Callable[[], tuple[Any, np.ndarray]]) -> None:
    buf, expected = make()
    outcome = asyncio.run(_register_and_write(buf, expected))
    print(f"{label} with provider {PROVIDER}: {outcome}")


def test_register_torch_cuda_tensor() -> None:
    torch = _torch_cuda()

    def make() -> tuple[Any, np.ndarray]:
        t = (torch.arange(N, device="cuda:0") % 251).to(torch.uint8)
        torch.cuda.synchronize()
        return t, t.cpu().numpy()

    _check("torch CUDA tensor", make)


def test_register_cupy_array() -> None:
    cp = _cupy_gpu()

    def make() -> tuple[Any, np.ndarray]:
        with cp.cuda.Device(0):
            a = (cp.arange(N) % 251).astype(cp.uint8)
            cp.cuda.Device(0).synchronize()
        return a, cp.asnumpy(a)

    _check("CuPy array", make)
