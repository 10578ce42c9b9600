"""Registered memory regions and how Python buffers become (address, length, device)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import _native
from .descriptor import MrDesc
from .errors import EngineClosed, RegistrationError, StaleRegion, UsageError

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class BufferSpan:
    """Raw memory of a buffer: where it is, how long, on which device (-1 = host)."""

    address: int
    length: int
    device: int
    owner: Any  # keeps the memory alive while registered


def span_of(buf: Any) -> BufferSpan:
    """Resolve numpy arrays, bytearray/memoryview, torch tensors and CuPy arrays."""
    mod = type(buf).__module__.split(".")[0]
    if mod == "torch":
        return _torch_span(buf)
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        return _cuda_array_span(buf, cai)
    ai = getattr(buf, "__array_interface__", None)
    if ai is not None and mod == "numpy":
        return _numpy_span(buf)
    try:
        address, length = _native.buffer_address(buf)
    except TypeError as e:
        raise RegistrationError(
            f"cannot register {type(buf).__name__}: not a numpy array, torch tensor, CuPy array "
            "or writable buffer (use register_ptr for raw memory)"
        ) from e
    return BufferSpan(address, length, -1, buf)


def _numpy_span(arr: Any) -> BufferSpan:
    if not arr.flags.c_contiguous:
        raise RegistrationError("numpy array is not C-contiguous")
    if not arr.flags.writeable:
        raise RegistrationError("numpy array is read-only (a peer may write it)")
    if arr.nbytes == 0:
        raise RegistrationError("cannot register an empty array")
    return BufferSpan(int(arr.__array_interface__["data"][0]), int(arr.nbytes), -1, arr)


def _torch_span(t: Any) -> BufferSpan:
    if not t.is_contiguous():
        raise RegistrationError("torch tensor is not contiguous")
    nbytes = int(t.numel() * t.element_size())
    if nbytes == 0:
        raise RegistrationError("cannot register an empty tensor")
    if t.device.type == "cpu":
        return BufferSpan(int(t.data_ptr()), nbytes, -1, t)
    if t.device.type == "cuda":
        return BufferSpan(int(t.data_ptr()), nbytes, int(t.device.index or 0), t)
    raise RegistrationError(f"torch tensors on {t.device.type} cannot be registered")


def _cuda_array_span(arr: Any, cai: dict[str, Any]) -> BufferSpan:
    if cai.get("strides") is not None:
        raise RegistrationError("CUDA array is not C-contiguous")
    shape = cai["shape"]
    n = 1
    for s in shape:
        n *= int(s)
    itemsize = int(arr.dtype.itemsize)
    device = getattr(getattr(arr, "device", None), "id", 0)
    if n == 0:
        raise RegistrationError("cannot register an empty array")
    return BufferSpan(int(cai["data"][0]), n * itemsize, int(device), arr)


class MemoryRegion:
    """Memory registered with one engine. Remote regions have a :attr:`descriptor` to hand
    to peers; local-only ones (``register(buf, remote=False)``) can only be sources."""

    __slots__ = ("__weakref__", "_desc", "_engine", "_owner", "address", "device", "id", "length", "remote")

    def __init__(
        self, engine: Engine, mr_id: int, span: BufferSpan, remote: bool, desc: MrDesc | None
    ) -> None:
        self._engine: weakref.ref[Engine] = weakref.ref(engine)
        self.id: int | None = mr_id
        self.address = span.address
        self.length = span.length
        self.device = span.device
        self.remote = remote
        self._desc = desc
        self._owner = span.owner

    @property
    def descriptor(self) -> MrDesc:
        """What a peer needs to write here. Raises for local-only or deregistered regions."""
        if self.id is None:
            raise StaleRegion("memory region was deregistered")
        if self._desc is None:
            raise UsageError("memory region was registered with remote=False: it has no descriptor")
        return self._desc

    @property
    def buffer(self) -> Any:
        """The object whose memory this is."""
        return self._owner

    @property
    def registered(self) -> bool:
        return self.id is not None

    def check(self, engine: Engine) -> int:
        """The native id, after checking the region is live and belongs to `engine`."""
        if self.id is None:
            raise StaleRegion("memory region was deregistered")
        owner = self._engine()
        if owner is not engine:
            raise StaleRegion("memory region belongs to another engine")
        if engine.closed:
            raise EngineClosed("engine is closed")
        return self.id

    def __repr__(self) -> str:
        state = "live" if self.id is not None else "deregistered"
        where = "host" if self.device < 0 else f"cuda:{self.device}"
        return f"MemoryRegion({self.length} bytes, {where}, remote={self.remote}, {state})"
