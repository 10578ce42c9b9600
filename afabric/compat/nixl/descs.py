"""NIXL's descriptor lists: transfer (addr, len, dev), registration (+ meta info) and
remote (+ agent name) lists.

The (addr, len, dev) columns live in one growable uint64 array, so a list built from an
Nx3 numpy array (vLLM's 12,800 block descriptors) costs one copy and the agent plans a
transfer over it with array operations, never a Python loop per descriptor.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from .enums import nixl_mem_t
from .status import nixl_status_t, nixlNotFoundError

_U64_MAX = (1 << 64) - 1


def mem_type_of(value: Any) -> nixl_mem_t:
    """A list's memory type from a ``nixl_mem_t`` (or its int value)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"memory type must be a nixl_mem_t, got {type(value).__name__}")
    try:
        return nixl_mem_t(int(value))
    except ValueError:
        raise ValueError(f"unknown memory type {int(value)}") from None


def _u64(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    v = int(value)
    if not 0 <= v <= _U64_MAX:
        raise ValueError(f"{what} {v} is outside 0..2**64-1")
    return v


def _blob(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise TypeError(f"meta info must be str or bytes, got {type(value).__name__}")


def _name(value: Any) -> str:
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, str):
        return value
    raise TypeError(f"agent name must be str, got {type(value).__name__}")


_D = TypeVar("_D", bound="_DescList")


class _DescList:
    """Columns (addr, len, dev) plus, in subclasses, one extra field per descriptor."""

    _width = 3  # tuple length a descriptor has in this kind of list
    _extra_what = ""

    def __init__(self, type: Any, descs: Any = None, init_size: int = 0) -> None:
        self._type = mem_type_of(type)
        self._extra: list[Any] = []
        if descs is None or (isinstance(descs, (int, np.integer)) and not isinstance(descs, bool)):
            n = _u64(init_size if descs is None else descs, "init_size")
            self._rows: npt.NDArray[np.uint64] = np.zeros((max(n, 4), 3), dtype=np.uint64)
            self._n = n
            self._extra = [self._default_extra()] * n
        elif isinstance(descs, np.ndarray):
            self._from_array(descs)
        elif isinstance(descs, (list, tuple)):
            self._from_tuples(descs)
        else:
            raise TypeError(
                f"descs must be a list of {self._width}-tuples or an Nx3 numpy array, "
                f"got {type(descs).__name__}"
            )

    # ---- construction ----

    def _from_array(self, arr: npt.NDArray[Any]) -> None:
        if arr.ndim != 2 or arr.shape[1] != 3:
            raise ValueError("descs must be a Nx3 numpy array")
        if arr.dtype not in (np.dtype(np.uint64), np.dtype(np.int64)):
            raise ValueError("descs must be a Nx3 numpy array of uint64 or int64")
        if not arr.flags.c_contiguous:
            raise ValueError("descs must be a C-contiguous numpy array")
        n = arr.shape[0]
        self._rows = np.zeros((max(n, 4), 3), dtype=np.uint64)
        self._rows[:n] = arr.view(np.uint64)
        self._n = n
        self._extra = [self._default_extra()] * n

    def _from_tuples(self, descs: Sequence[Any]) -> None:
        n = len(descs)
        self._rows = np.zeros((max(n, 4), 3), dtype=np.uint64)
        self._n = 0
        for d in descs:
            if not isinstance(d, tuple):
                raise TypeError("Each descriptor must be a tuple when provided as a list")
            if len(d) != self._width:
                raise ValueError(f"Each descriptor tuple must have exactly {self._width} elements")
            self.addDesc(d)

    def _default_extra(self) -> Any:
        return None

    def _parse(self, desc: Any) -> tuple[int, int, int, Any]:
        if not isinstance(desc, tuple) or len(desc) < self._width:
            raise TypeError(f"a descriptor is a {self._width}-tuple, got {desc!r}")
        extra = self._check_extra(desc[3]) if self._width == 4 else None
        return _u64(desc[0], "addr"), _u64(desc[1], "len"), _u64(desc[2], "devId"), extra

    def _check_extra(self, value: Any) -> Any:
        return value

    # ---- NIXL's methods ----

    def getType(self) -> nixl_mem_t:
        return self._type

    def descCount(self) -> int:
        return self._n

    def isEmpty(self) -> bool:
        return self._n == 0

    def _check_index(self, i: Any) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise TypeError(f"index must be an int, got {type(i).__name__}")
        if not 0 <= int(i) < self._n:
            raise IndexError(f"index {int(i)} out of range for a list of {self._n}")
        return int(i)

    def _row(self, i: int) -> tuple[Any, ...]:
        a, n, d = (int(v) for v in self._rows[i])
        return (a, n, d) if self._width == 3 else (a, n, d, self._shown_extra(self._extra[i]))

    def _shown_extra(self, value: Any) -> Any:
        return value

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return self._row(self._check_index(i))

    def __setitem__(self, i: int, desc: tuple[Any, ...]) -> None:
        k = self._check_index(i)
        a, n, d, extra = self._parse(desc)
        self._rows[k] = (a, n, d)
        self._extra[k] = extra

    def addDesc(self, desc: tuple[Any, ...]) -> None:
        a, n, d, extra = self._parse(desc)
        if self._n == len(self._rows):
            grown = np.zeros((2 * len(self._rows), 3), dtype=np.uint64)
            grown[: self._n] = self._rows[: self._n]
            self._rows = grown
        self._rows[self._n] = (a, n, d)
        self._extra.append(extra)
        self._n += 1

    append = addDesc

    def remDesc(self, index: int) -> None:
        k = self._check_index(index)
        self._rows[k : self._n - 1] = self._rows[k + 1 : self._n]
        del self._extra[k]
        self._n -= 1

    def clear(self) -> None:
        self._n = 0
        self._extra = []

    def index(self, desc: tuple[Any, ...]) -> int:
        a, n, d, extra = self._parse(desc)
        hits = np.flatnonzero(
            (self._rows[: self._n, 0] == a)
            & (self._rows[: self._n, 1] == n)
            & (self._rows[: self._n, 2] == d)
        )
        for k in hits:
            if self._width == 3 or self._extra[int(k)] == extra:
                return int(k)
        raise nixlNotFoundError(f"{nixl_status_t.NIXL_ERR_NOT_FOUND.name}: no such descriptor")

    def print(self) -> None:
        sys.stdout.write(self.to_string() + "\n")

    def to_string(self) -> str:
        lines = [f"DescList of mem type {self._type.name}"]
        lines += [f"  Desc {self._row(i)}" for i in range(self._n)]
        return "\n".join(lines)

    # ---- Python protocol ----

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _DescList)
        return (
            self._type == other._type
            and self._n == other._n
            and bool(np.array_equal(self._rows[: self._n], other._rows[: other._n]))
            and (self._width == 3 or self._extra == other._extra)
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, like upstream's lists

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._type.name}, {self._n} descriptors)"

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self).__name__, int(self._type), self.columns().tobytes(), list(self._extra)))

    # ---- for the agent ----

    def columns(self) -> npt.NDArray[np.uint64]:
        """The (addr, len, dev) rows, a read-only Nx3 uint64 view."""
        view = self._rows[: self._n]
        view.flags.writeable = False  # only the view; the list itself stays mutable
        return view

    def extras(self) -> list[Any]:
        return self._extra[: self._n]


class nixlXferDList(_DescList):
    """Descriptors of a transfer: (addr, len, devId)."""

    def trim(self) -> nixlXferDList:
        return self


class nixlRegDList(_DescList):
    """Descriptors to register: (addr, len, devId, metaInfo)."""

    _width = 4

    def _default_extra(self) -> bytes:
        return b""

    def _check_extra(self, value: Any) -> bytes:
        return _blob(value)

    def trim(self) -> nixlXferDList:
        """The same descriptors without their meta info."""
        return nixlXferDList(self._type, np.ascontiguousarray(self.columns()))


class nixlRemoteDList(_DescList):
    """Descriptors naming another agent's memory: (addr, len, devId, agent name)."""

    _width = 4

    def _default_extra(self) -> str:
        return ""

    def _check_extra(self, value: Any) -> str:
        return _name(value)

    def _from_array(self, arr: npt.NDArray[Any]) -> None:
        raise TypeError("a remote descriptor list is built from (addr, len, devId, agent name) tuples")


_KINDS: dict[str, type[_DescList]] = {c.__name__: c for c in (nixlXferDList, nixlRegDList, nixlRemoteDList)}


def _rebuild(kind: str, mem: int, rows: bytes, extra: list[Any]) -> _DescList:
    """Unpickle a list (see ``_DescList.__reduce__``)."""
    cls = _KINDS[kind]
    arr = np.frombuffer(rows, dtype=np.uint64).reshape(-1, 3).copy()
    out = cls(nixl_mem_t(mem), arr) if cls is not nixlRemoteDList else cls(nixl_mem_t(mem))
    if cls is nixlRemoteDList:
        for (a, n, d), name in zip(arr.tolist(), extra, strict=True):
            out.addDesc((a, n, d, name))
    elif cls is nixlRegDList:
        if len(extra) != out.descCount():
            raise ValueError("corrupted descriptor list")
        out._extra = [_blob(e) for e in extra]
    return out
