"""Registered memory stays alive and in place while peers may write it: the engine holds a
region (and its buffer) until deregister or close, even when the caller dropped both, and
buffers that could move (bytearray, array.array, numpy arrays that own their memory, CPU
torch tensors) cannot be resized while registered. Plus what register refuses and accepts
(object arrays, read-only memory) and how closed engines answer."""

from __future__ import annotations

import array
import ctypes
import gc
import weakref
from typing import Any

import numpy as np
import pytest

import afabric
from afabric import errors

from .procs import Ctl, Peer

try:
    import torch
except ModuleNotFoundError:  # the default suite's install has none (bash tests/run.sh --all has)
    torch = None

SIZES = [4096, 65536, 4 << 20]
PATTERN = 0xAB


def nonzero(arr: np.ndarray[Any, Any] | None) -> int:
    return -1 if arr is None else int(np.count_nonzero(arr))


async def dropping_target(ctl: Ctl, provider: str) -> tuple[bool, int, list[int], bool]:
    """Registers buffers and drops them and their regions at once (keeping descriptors
    only), fills the heap with fresh buffers, and lets the test write to the descriptors."""
    refs: list[weakref.ref[np.ndarray[Any, Any]]] = []
    async with afabric.Engine(provider) as eng:
        descs = []
        for n in SIZES:
            arr = np.zeros(n, dtype=np.uint8)
            refs.append(weakref.ref(arr))
            descs.append(bytes(eng.register(arr).descriptor))
            del arr
        gc.collect()
        held = all(r() is not None for r in refs)
        live = [bytearray(n) for n in SIZES for _ in range(8)]  # where freed memory would go
        ctl.put(descs)
        assert await ctl.get() == "written"
        corrupted = sum(1 for b in live if any(b))
        landed = [nonzero(r()) for r in refs]
    gc.collect()
    released = all(r() is None for r in refs)
    return held, corrupted, landed, released


async def test_dropped_region_stays_alive_until_close(provider: str, peers: list[Peer]) -> None:
    """Dropping a region and its buffer does not free the memory a peer may still write:
    the writes land in the (held) buffer, nothing else changes, and close releases it."""
    target = Peer(dropping_target, provider)
    peers.append(target)
    descs = [afabric.MrDesc.from_bytes(b) for b in await target.get()]
    async with afabric.Engine(provider) as eng:
        src = eng.register(np.full(max(SIZES), PATTERN, dtype=np.uint8), remote=False)
        for d, n in zip(descs, SIZES, strict=True):
            for _ in range(3):
                await eng.write(src, d, n)
    target.put("written")
    held, corrupted, landed, released = await target.result()
    assert held, "the engine let a registered buffer be freed"
    assert corrupted == 0, f"{corrupted} unrelated live buffers were written"
    assert landed == SIZES
    assert released, "close did not release the buffers it held"


async def test_deregister_releases_the_buffer(provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        arr = np.zeros(4096, dtype=np.uint8)
        ref = weakref.ref(arr)
        mr = eng.register(arr)
        del arr
        gc.collect()
        assert ref() is not None
        eng.deregister(mr)
        del mr
        gc.collect()
        assert ref() is None, "deregistered and dropped, but still held"


# ---- buffers that could move ----


def pinned_buffers() -> dict[str, Any]:
    return {
        "bytearray": bytearray(4096),
        "array.array": array.array("b", bytes(4096)),
        "numpy": np.zeros(4096, dtype=np.uint8),
        "numpy view": np.zeros(8192, dtype=np.uint8)[:4096],
        **({"torch": torch.zeros(4096, dtype=torch.uint8)} if torch is not None else {}),
    }


def try_to_move(name: str, buf: Any) -> str:
    """Grow the buffer the way its type allows; what happened."""
    try:
        if name in ("bytearray", "array.array"):
            buf.extend(bytes(1 << 20))
        elif name == "numpy":
            buf.resize(1 << 20, refcheck=False)
        elif name == "numpy view":
            buf.base.resize(1 << 20, refcheck=False)
        elif name == "torch":
            buf.resize_(1 << 20)
    except (BufferError, ValueError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return "moved"


def contents(name: str, buf: Any) -> int:
    if name == "torch":  # its storage: a refused resize_ leaves the tensor's shape grown (torch)
        whole = torch.empty(0, dtype=torch.uint8).set_(buf.untyped_storage())
        return int(torch.count_nonzero(whole))
    return int(np.count_nonzero(np.frombuffer(buf, dtype=np.uint8)))


async def resizing_target(ctl: Ctl, provider: str) -> dict[str, tuple[str, int, bool]]:
    """Registers each kind of movable buffer, tries to grow it, lets the test write to it,
    and reports (what the resize did, bytes the write set, whether it grows after close)."""
    out: dict[str, tuple[str, int, bool]] = {}
    bufs = pinned_buffers()
    async with afabric.Engine(provider) as eng:
        mrs = {name: eng.register(b) for name, b in bufs.items()}
        tried = {name: try_to_move(name, b) for name, b in bufs.items()}
        ctl.put({name: bytes(mr.descriptor) for name, mr in mrs.items()})
        assert await ctl.get() == "written"
        seen = {name: contents(name, b) for name, b in bufs.items()}
    # closed: nothing can reach the memory any more, so it may move again
    for name, b in bufs.items():
        out[name] = (tried[name], seen[name], try_to_move(name, b) == "moved")
    return out


async def test_registered_buffers_cannot_move(provider: str, peers: list[Peer]) -> None:
    """A registered bytearray / array.array / numpy array (or the array it views) / CPU
    tensor cannot be grown while registered; the peer's write lands in it; after close it
    can be resized again."""
    target = Peer(resizing_target, provider)
    peers.append(target)
    descs = await target.get()
    async with afabric.Engine(provider) as eng:
        src = eng.register(np.full(4096, PATTERN, dtype=np.uint8), remote=False)
        for blob in descs.values():
            await eng.write(src, afabric.MrDesc.from_bytes(blob), 4096)
    target.put("written")
    result = await target.result()
    for name, (tried, seen, moves_after) in result.items():
        print(f"\n{name}: {tried}")
        assert tried != "moved", f"a registered {name} was resized"
        assert seen == 4096, f"{name}: the write landed elsewhere ({seen} bytes set)"
        assert moves_after, f"{name}: still pinned after the engine closed"


async def test_torch_storage_swap_keeps_memory(provider: str) -> None:
    """t.set_() after registration points the tensor elsewhere; the registered memory
    stays alive (held by the engine) and the tensor's old contents are intact."""
    if torch is None:
        pytest.skip("torch is not installed (bash tests/run.sh --all installs it)")
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        t = torch.arange(1024, dtype=torch.int32)
        addr = t.data_ptr()
        mr = b.register(t)
        assert t.data_ptr() == addr and int(t[1000]) == 1000  # same memory, no copy
        t.set_(torch.zeros(4, dtype=torch.int32).untyped_storage())
        gc.collect()
        live = [bytearray(4096) for _ in range(32)]  # where freed memory would go
        src = a.register(np.full(4096, PATTERN, dtype=np.uint8), remote=False)
        await a.write(src, mr.descriptor, 4096)  # into memory the tensor no longer uses
        assert not any(any(x) for x in live), "the write hit a live buffer"
        assert mr.buffer is t


async def test_shared_torch_storage_refused(provider: str) -> None:
    if torch is None:
        pytest.skip("torch is not installed (bash tests/run.sh --all installs it)")
    async with afabric.Engine(provider) as eng:
        base = torch.zeros(8192, dtype=torch.uint8)
        with pytest.raises(errors.RegistrationError, match="shares a resizable storage"):
            eng.register(base[:4096])
        fixed = torch.from_numpy(np.zeros(4096, dtype=np.uint8))  # cannot be resized at all
        eng.register(fixed[:1024])


# ---- what register accepts ----


async def test_object_arrays_refused(provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        for arr in (
            np.array([object(), 1], dtype=object),
            np.zeros(4, dtype=[("a", "i4"), ("o", "O")]),
        ):
            with pytest.raises(errors.RegistrationError, match="Python objects"):
                eng.register(arr)
            with pytest.raises(errors.RegistrationError, match="Python objects"):
                eng.register(arr, remote=False)
        with pytest.raises(errors.RegistrationError, match="Python objects"):
            eng.register((ctypes.py_object * 4)())


async def test_read_only_memory_is_a_source_only(provider: str) -> None:
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        ro = np.full(4096, 7, dtype=np.uint8)
        ro.flags.writeable = False
        for buf in (b"\x07" * 4096, ro, memoryview(b"\x07" * 4096)):
            with pytest.raises(errors.RegistrationError, match=r"read-only.*remote=False"):
                a.register(buf)
            src = a.register(buf, remote=False)
            dst = np.zeros(4096, dtype=np.uint8)
            await a.write(src, b.register(dst).descriptor, 4096)
            assert int(np.count_nonzero(dst == 7)) == 4096


async def test_closed_engine_and_its_regions_refuse(provider: str) -> None:
    eng = afabric.Engine(provider)
    mr = eng.register(np.zeros(64, dtype=np.uint8))
    assert bytes(mr.descriptor)
    await eng.aclose()
    with pytest.raises(errors.EngineClosed):
        mr.descriptor  # noqa: B018 - the property raises
    with pytest.raises(errors.EngineClosed):
        async with eng:
            pass


async def test_send_text_is_a_type_error(provider: str) -> None:
    async with afabric.Engine(provider) as eng:
        with pytest.raises(TypeError, match="bytes") as info:
            await eng.send(eng.address, "text")  # type: ignore[arg-type]
        assert isinstance(info.value, errors.AfabricError)
        assert "encode" in str(info.value)
