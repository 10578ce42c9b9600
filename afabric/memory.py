"""Registered memory regions and how Python buffers become (address, length, device)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .descriptor import MrDesc
from .errors import EngineClosed, RegistrationError, StaleRegion, UsageError


class EngineView(Protocol):
    """What a region needs of its engine (:class:`afabric.Engine`, which imports this module
    to make regions): declared here so this module stands below the engine."""

    @property
    def closed(self) -> bool: ...


@dataclass(frozen=True)
class BufferSpan:
    """Raw memory of a buffer: where it is, how long, on which device (-1 = host)."""

    address: int
    length: int
    device: int
    owner: Any  # keeps the memory alive while registered
    pin: Any = None  # holds the memory in place while registered (a buffer export, ...)
    readonly: bool = False  # the buffer is read-only: never a write target nor a read destination


def span_of(buf: Any, remote: bool = True) -> BufferSpan:
    """Resolve numpy arrays, bytearray/memoryview (any buffer), torch tensors and CuPy
    arrays, and pin them: while the span's ``pin`` lives, the memory cannot move or be
    freed through the object (a resize raises). Read-only memory only with ``remote=False``."""
    mod = type(buf).__module__.split(".")[0]
    if mod == "torch":
        return _torch_span(buf)
    cai = getattr(buf, "__cuda_array_interface__", None)
    if cai is not None:
        return _cuda_array_span(buf, cai)
    ai = getattr(buf, "__array_interface__", None)
    if ai is not None and mod == "numpy":
        return _numpy_span(buf, remote)
    return _buffer_span(buf, remote)


def _read_only(what: str) -> RegistrationError:
    return RegistrationError(
        f"{what} is read-only: a region peers may write (remote=\"w\" or \"rw\") must be writable; "
        "register it with remote=\"r\" (peers read it) or remote=False (a local source)"
    )


def _buffer_span(buf: Any, remote: bool) -> BufferSpan:
    """Any buffer-protocol object, through one numpy view of its bytes. That view holds a
    buffer export for the registration's lifetime, so a bytearray, array.array or mmap
    registered here cannot be resized or closed under the peer's writes (BufferError)."""
    try:
        mv = memoryview(buf)
    except TypeError as e:
        raise RegistrationError(
            f"cannot register {type(buf).__name__}: not a numpy array, torch tensor, CuPy array "
            "or buffer (use register_ptr for raw memory)"
        ) from e
    if "O" in mv.format:
        raise RegistrationError(
            "a buffer of Python objects cannot be registered (peers would write pointers)"
        )
    if mv.readonly and remote:
        raise _read_only(type(buf).__name__)
    if not mv.c_contiguous:
        raise RegistrationError("buffer is not C-contiguous")
    if mv.nbytes == 0:
        raise RegistrationError("cannot register an empty buffer")
    flat = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    view = np.frombuffer(flat, dtype=np.uint8)
    return BufferSpan(int(view.__array_interface__["data"][0]), int(view.nbytes), -1, buf, view, mv.readonly)


def _numpy_span(arr: Any, remote: bool) -> BufferSpan:
    if arr.dtype.hasobject:
        raise RegistrationError(
            f"numpy array of dtype {arr.dtype} holds Python objects: it cannot be registered "
            "(peers would write object pointers)"
        )
    if not arr.flags.c_contiguous:
        raise RegistrationError("numpy array is not C-contiguous")
    if not arr.flags.writeable and remote:
        raise _read_only("numpy array")
    if arr.nbytes == 0:
        raise RegistrationError("cannot register an empty array")
    # ndarray.resize (also with refcheck=False) refuses an array that has weak references:
    # hold one on the array and on every array it views, whichever owns the memory
    pins: list[Any] = []
    a: Any = arr
    while isinstance(a, np.ndarray):
        pins.append(weakref.ref(a))
        a = a.base
    return BufferSpan(
        int(arr.__array_interface__["data"][0]), int(arr.nbytes), -1, arr, tuple(pins),
        not arr.flags.writeable,
    )


def _torch_span(t: Any) -> BufferSpan:
    if not t.is_contiguous():
        raise RegistrationError("torch tensor is not contiguous")
    nbytes = int(t.numel() * t.element_size())
    if nbytes == 0:
        raise RegistrationError("cannot register an empty tensor")
    if t.device.type not in ("cpu", "cuda"):
        raise RegistrationError(f"torch tensors on {t.device.type} cannot be registered")
    pin = _fixed_storage(t)
    device = -1 if t.device.type == "cpu" else int(t.device.index or 0)
    return BufferSpan(int(t.data_ptr()), nbytes, device, t, pin)


def _fixed_storage(t: Any) -> Any:
    """Make ``t``'s storage unable to move, and return it (held while registered: it keeps
    the memory alive if ``t.set_()`` points the tensor elsewhere).

    A tensor's own storage is resizable: ``t.resize_()`` to a larger size reallocates it and
    frees the old memory. torch has no switch to make a storage fixed, but a storage made
    from DLPack is fixed (resizing it raises). So ``t`` is moved onto such a storage over the
    *same* memory (no copy; the DLPack owner keeps the original storage alive): afterwards
    ``t.resize_()`` beyond its size raises RuntimeError. Another tensor sharing the original
    storage could still resize it, so a shared resizable storage is refused."""
    import torch
    from torch.utils.dlpack import from_dlpack

    storage = t.untyped_storage()
    if not storage.resizable():
        return storage
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    # references: t's own, and `storage` here
    if use_count is not None and int(use_count(storage._cdata)) > 2:
        raise RegistrationError(
            "torch tensor shares a resizable storage with other tensors (a view, or viewed): "
            "any of them could resize it and move the memory; register the tensor before taking "
            "views of it, or memory that cannot move (torch.from_numpy)"
        )
    whole = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    fixed = from_dlpack(whole).untyped_storage()
    if fixed.data_ptr() != storage.data_ptr() or fixed.nbytes() != storage.nbytes():
        raise RegistrationError("torch tensor: could not pin its storage in place")
    try:
        with torch.no_grad():
            t.set_(fixed, t.storage_offset(), t.size(), t.stride())
    except RuntimeError as e:
        raise RegistrationError(f"torch tensor: could not pin its storage in place: {e}") from e
    return fixed


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
    to peers; local-only ones (``register(buf, remote=False)``) can only be sources.

    The engine holds the region (and so its buffer) until ``deregister`` or ``close``:
    dropping the region does not deregister it, and the memory stays alive and in place
    while peers may still write there."""

    __slots__ = (
        "__weakref__", "_desc", "_engine", "_owner", "_pin", "access", "address", "device", "id", "length",
        "readonly", "remote",
    )  # fmt: skip

    def __init__(
        self, engine: EngineView, mr_id: int, span: BufferSpan, access: str, desc: MrDesc | None
    ) -> None:
        self._engine: weakref.ref[EngineView] = weakref.ref(engine)
        self.id: int | None = mr_id
        self.address = span.address
        self.length = span.length
        self.device = span.device
        self.access = access  # what peers may do: "w", "r", "rw", or "" (local only)
        self.remote = bool(access)
        self.readonly = span.readonly  # a read-only buffer: no read may land here
        self._desc = desc
        self._owner = span.owner
        self._pin = span.pin

    def _unpin(self) -> None:
        """The engine is closed (nothing can reach the memory any more): let it move."""
        self._pin = None

    @property
    def descriptor(self) -> MrDesc:
        """What a peer needs to reach this region: send ``bytes(mr.descriptor)`` to it.

        Raises:
            UsageError: the region is local-only (``remote=False``).
            StaleRegion: the region was deregistered.
            EngineClosed: its engine is closed.
        """
        if self.id is None:
            raise StaleRegion("memory region was deregistered")
        engine = self._engine()
        if engine is None or engine.closed:
            raise EngineClosed("memory region's engine is closed")
        if self._desc is None:
            raise UsageError("memory region was registered with remote=False: it has no descriptor")
        return self._desc

    @property
    def buffer(self) -> Any:
        """The object whose memory this is."""
        return self._owner

    @property
    def registered(self) -> bool:
        """True while the region is registered with an open engine."""
        return self.id is not None

    def check(self, engine: EngineView) -> int:
        """The native id, after checking the region is live and belongs to ``engine``.

        Args:
            engine: the engine about to use the region.

        Returns:
            The shim's id of the region.

        Raises:
            EngineClosed: its engine is closed.
            StaleRegion: the region was deregistered or belongs to another engine.
        """
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
        remote = repr(self.access) if self.access else "False"
        return f"MemoryRegion({self.length} bytes, {where}, remote={remote}, {state})"
