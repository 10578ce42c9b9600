"""CUDA watchers driven by a real GPU kernel (CuPy): every layer's bump is seen, the chain
of values stays unbroken when layers are faster than the watcher, and a write armed with
``when=watcher.reaches(L)`` is released by the kernel's L-th bump and lands in another
process's host memory.

Skipped, not faked, without CuPy or a CUDA GPU (failed instead where AFABRIC_REQUIRE_GPU=1,
as tests/gpu/run_device.sh sets on the GPU machine). The tests are plain functions that run
their own event loop, so they need no pytest plugin (the GPU machine has no
pytest-asyncio); tests/gpu/run_device.sh runs them there.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import afabric
from afabric.bench import trigger as bench_trigger


@functools.cache
def _probe_cupy() -> tuple[Any, str]:
    """(cupy, "") when CuPy works and sees a GPU, else (None, why not)."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or CUDA libraries CuPy cannot load
        return None, f"CuPy is not usable here ({type(e).__name__}: {e})"
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError: no driver or no device
        return None, f"no CUDA GPU ({type(e).__name__}: {e})"
    return (cupy, "") if count > 0 else (None, "no CUDA GPU")


def _cupy() -> Any:
    """CuPy, or skip the test (fail it where AFABRIC_REQUIRE_GPU=1: the GPU machine)."""
    cp, why = _probe_cupy()
    if cp is None:
        if os.environ.get("AFABRIC_REQUIRE_GPU") == "1":
            pytest.fail(f"AFABRIC_REQUIRE_GPU=1 but {why}")
        pytest.skip(why)
    return cp


DEVICE = 0
PROVIDER = "tcp"  # loopback works wherever the GPU machine runs; shm is not needed here
LAYERS = 24
# Long enough that the shim's watcher thread (a 20 µs nap when idle, 200 µs of spinning
# after a change) sees every layer on its own, even on a virtualized machine.
LAYER_US = float(os.environ.get("AFABRIC_GPU_LAYER_US", "1000"))
FAST_LAYERS = 64
FAST_LAYER_US = 20.0


def _kernel() -> Any:
    src = Path(__file__).with_name("layers.cu").read_text()
    k = _cupy().RawKernel(src, "layers")
    compile_now = getattr(k, "compile", None)  # NVRTC now, not while layers are timed
    if compile_now is not None:
        compile_now()
    return k


def _cycles_per_us() -> float:
    """SM cycles per µs at the device's maximum clock: a spin of n·this cycles lasts at least
    n µs (longer while the GPU runs below its top clock)."""
    try:
        khz = int(_cupy().cuda.runtime.deviceGetAttribute(13, DEVICE))  # cudaDevAttrClockRate, kHz
    except Exception:  # noqa: BLE001 - an attribute this CUDA no longer has: assume 2 GHz
        khz = 0
    return (khz if khz > 0 else 2_000_000) / 1e3


def _launch(k: Any, stream: Any, word_ptr: int, layers: int, layer_us: float, stamps: Any) -> None:
    cycles = int(layer_us * _cycles_per_us())
    with stream:
        k((1,), (1,), (np.uint64(word_ptr), np.int32(layers), np.int64(cycles), stamps))


async def _collect(w: afabric.UvmWatcher, until: int, timeout: float) -> list[tuple[int, int, int]]:
    """Changes (old, new, host time seen) until the word reaches ``until``."""
    seen: list[tuple[int, int, int]] = []

    async def run() -> None:
        async for old, new in w:
            seen.append((old, new, time.monotonic_ns()))
            if new >= until:
                return

    try:
        await asyncio.wait_for(run(), timeout)
    except asyncio.TimeoutError:
        raise AssertionError(f"watcher stopped at {w.value} (wanted {until}); changes seen: {seen}") from None
    return seen


async def _sync(stream: Any) -> None:
    await asyncio.get_running_loop().run_in_executor(None, stream.synchronize)


async def _layers_seen(layers: int, layer_us: float) -> tuple[list[tuple[int, int, int]], Any]:
    cp = _cupy()
    k = _kernel()
    stamps = cp.zeros(max(layers, 1), dtype=cp.uint64)
    stream = cp.cuda.Stream(non_blocking=True)
    async with afabric.Engine(PROVIDER) as eng:
        w = eng.uvm_watcher(device=DEVICE)
        assert w.device == DEVICE and w.device_ptr != 0, w
        assert w.value == 0
        try:
            _launch(k, stream, w.device_ptr, layers, layer_us, stamps)
            seen = await _collect(w, layers, timeout=60.0)
        finally:
            await _sync(stream)  # the kernel must be done with the word before it is freed
        assert w.value == layers
    return seen, cp.asnumpy(stamps)


def _median(a: Any) -> float:
    return float(np.median(a)) if len(a) else 0.0


def _report(label: str, seen: list[tuple[int, int, int]], stamps: Any) -> None:
    """What the layers and the watcher did (shown with -rA / -s; nothing asserted on it)."""
    gpu_us = np.diff(stamps.astype(np.int64)) / 1e3
    host_us = np.diff(np.array([t for _, _, t in seen], dtype=np.int64)) / 1e3
    merged = sum(1 for old, new, _ in seen if new - old > 1)
    print(
        f"{label}: {len(seen)} changes seen for {len(stamps)} layers ({merged} merged); "
        f"GPU time between layer ends: median {_median(gpu_us):.1f} µs; "
        f"host time between changes seen: median {_median(host_us):.1f} µs"
    )


def test_every_gpu_layer_is_observed() -> None:
    seen, stamps = asyncio.run(_layers_seen(LAYERS, LAYER_US))
    _report(f"{LAYERS} layers of {LAYER_US:g} µs", seen, stamps)
    pairs = [(old, new) for old, new, _ in seen]
    want = [(v - 1, v) for v in range(1, LAYERS + 1)]
    assert pairs == want, f"not every layer was seen on its own: {pairs}"


def test_chain_unbroken_when_layers_outrun_the_watcher() -> None:
    """Layers faster than the watcher's nap may merge, but the (old, new) chain never breaks."""
    seen, stamps = asyncio.run(_layers_seen(FAST_LAYERS, FAST_LAYER_US))
    _report(f"{FAST_LAYERS} layers of {FAST_LAYER_US:g} µs", seen, stamps)
    assert seen, "no change seen"
    assert seen[0][0] == 0 and seen[-1][1] == FAST_LAYERS
    for (_, prev_new, _), (old, new, _) in itertools.pairwise(seen):
        assert old == prev_new and new > old, seen


def test_gpu_bump_releases_triggered_write_to_another_process() -> None:
    cp = _cupy()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=bench_trigger.run_target, args=(child, PROVIDER), daemon=True)
    proc.start()
    told = False
    try:
        assert parent.poll(60), "target process did not start"
        desc_blob, imm = parent.recv()
        payload = np.random.default_rng(7).integers(0, 256, bench_trigger.SIZE, dtype=np.uint8)

        async def main() -> None:
            k = _kernel()
            stamps = cp.zeros(LAYERS, dtype=cp.uint64)
            stream = cp.cuda.Stream(non_blocking=True)
            async with afabric.Engine(PROVIDER) as eng:
                mr = eng.register(payload, remote=False)
                w = eng.uvm_watcher(device=DEVICE)
                desc = afabric.MrDesc.from_bytes(desc_blob)
                write = asyncio.ensure_future(
                    eng.write(mr, desc, bench_trigger.SIZE, imm=imm, when=w.reaches(LAYERS))
                )
                try:
                    # all layers but the last: the write stays armed
                    _launch(k, stream, w.device_ptr, LAYERS - 1, LAYER_US, stamps)
                    await _collect(w, LAYERS - 1, timeout=60.0)
                    await _sync(stream)
                    await asyncio.sleep(0.1)
                    assert not write.done(), "the write fired before the GPU reached its value"
                    assert w.value == LAYERS - 1
                    # the last layer's bump releases it, with no Python in between
                    _launch(k, stream, w.device_ptr, 1, LAYER_US, stamps)
                    await asyncio.wait_for(asyncio.shield(write), 30.0)
                    assert w.value == LAYERS
                finally:
                    await _sync(stream)
                    if not write.done():
                        write.cancel()
                    await asyncio.gather(write, return_exceptions=True)

        asyncio.run(main())
        parent.send((1, payload.tobytes()))
        told = True
        assert parent.poll(60), "target process did not answer"
        state, detail = parent.recv()
        assert state == "ok", detail
    finally:
        if not told:
            parent.send((None, b""))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
