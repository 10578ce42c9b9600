"""The routing plan: which training rank sends which slice to which inference rank, at which
destination offsets. Computed once from metadata, reused unchanged every update.

A :class:`Task` is one slice of one training parameter, prepared by one training rank
(sliced from its own shard, or from the unsharded tensor when a destination needs data
that crosses shard boundaries, e.g. a 128-row fp8 tile), converted (dtype cast, or fp8
with tile scales) into a staging buffer and written to every destination that needs those
bytes. Writes are columns (task, inference rank, source offset, destination offset,
length). Tasks go to the least-loaded rank that can prepare them, largest first, so no rank
sends much more than the average. The plan is plain data: :meth:`Plan.to_bytes` /
:meth:`Plan.from_bytes` ship it between ranks.
"""

from __future__ import annotations

import io
import json
import math
import struct
import zipfile
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ..errors import InvalidArgument
from .layout import FP8, DestTensor, RankLayout
from .meta import Box, SourceParam, box_numel, box_shape, dtype_size, intersect
from .npz import read_members

MiB = 1 << 20
STAGE_ALIGN = 16
"""fp8 scales follow the data in a task's staging bytes, at a 16-byte boundary."""


@dataclass(frozen=True)
class Task:
    """One slice of one training parameter, prepared by ``sender`` and written to
    ``n_writes`` places (rows ``first_write ...`` of the plan's write columns)."""

    index: int
    param: str
    box: Box
    out_dtype: str
    block: int  # fp8 tile size; 0 for a plain copy
    sender: int  # global rank
    unshard: bool  # prepared from the unsharded parameter (full_tensor())
    group: int
    first_write: int
    n_writes: int

    @property
    def fp8(self) -> bool:
        return self.block > 0

    @property
    def data_bytes(self) -> int:
        return box_numel(self.box) * dtype_size(self.out_dtype)

    @property
    def scale_offset(self) -> int:
        return -(-self.data_bytes // STAGE_ALIGN) * STAGE_ALIGN

    @property
    def nbytes(self) -> int:
        """Staging bytes: the converted slice, then (fp8) its tile scales."""
        if not self.fp8:
            return self.data_bytes
        rows, cols = box_shape(self.box)
        return self.scale_offset + 4 * (-(-rows // self.block)) * (-(-cols // self.block))


@dataclass(frozen=True)
class Group:
    """Parameters sharing one mesh and placements: their tasks run together, one group
    after another. ``unshard``: the parameters every rank of the mesh unshards, in order
    (``full_tensor()`` is a collective)."""

    key: str
    mesh_ranks: tuple[int, ...]
    unshard: tuple[str, ...]
    first_task: int
    n_tasks: int


@dataclass
class PlanOptions:
    """``max_task_bytes``: slices larger than this are cut (bounds staging memory per task).
    ``direct_min_bytes``: a parameter whose shards would cut a destination slice into
    pieces smaller than this is unsharded instead (fewer, larger writes).
    ``unshard``: "auto" (when needed or cheaper), "never" (fail if a destination needs
    data across shards) or "always" (every sharded parameter)."""

    max_task_bytes: int = 16 * MiB
    direct_min_bytes: int = 256 << 10
    unshard: str = "auto"

    def check(self) -> None:
        if self.unshard not in ("auto", "never", "always"):
            raise InvalidArgument(f"unshard must be auto, never or always, got {self.unshard!r}")
        if self.max_task_bytes < 4096:
            raise InvalidArgument("max_task_bytes must be at least 4096")


@dataclass
class _Piece:
    """A destination slice: the same (param, box, dtype) wanted by one or more ranks."""

    param: str
    box: Box
    out_dtype: str
    block: int
    dests: list[tuple[int, int, int]] = field(default_factory=list)  # (inference idx, data, scale off)


def copy_segments(piece: Box, band: Box, elt: int) -> list[tuple[int, int, int]]:
    """``(src, dst, length)`` byte runs taking ``band`` (staged contiguous, C order) to its
    place in ``piece`` (laid out C order from offset 0); adjacent runs merged."""
    p, t = box_shape(piece), box_shape(band)
    rel = [b[0] - q[0] for b, q in zip(band, piece, strict=True)]
    partial = [d for d in range(len(p)) if t[d] != p[d]]
    if not partial:
        return [(0, 0, math.prod(t) * elt)]
    k = partial[-1]
    strides = [math.prod(p[d + 1 :]) for d in range(len(p))]
    seg = t[k] * strides[k]
    base = sum(rel[d] * strides[d] for d in range(k + 1))
    if k == 0:
        return [(0, base * elt, seg * elt)]
    outer = np.indices(t[:k]).reshape(k, -1)
    dst = base + (outer * np.array(strides[:k], dtype=np.int64)[:, None]).sum(axis=0)
    runs: list[tuple[int, int, int]] = []
    for n, d in enumerate(dst.tolist()):
        if runs and runs[-1][1] + runs[-1][2] == d * elt and runs[-1][0] + runs[-1][2] == n * seg * elt:
            s0, d0, ln = runs[-1]
            runs[-1] = (s0, d0, ln + seg * elt)
        else:
            runs.append((n * seg * elt, d * elt, seg * elt))
    return runs


def _row_bands(box: Box, n: int, multiple: int) -> list[Box]:
    """``box`` cut along dimension 0 into about ``n`` bands whose row counts are multiples
    of ``multiple`` (the last may be shorter)."""
    lo, hi = box[0]
    rows = hi - lo
    units = -(-rows // multiple)
    n = max(1, min(n, units))
    per = -(-units // n) * multiple
    out = []
    for r in range(lo, hi, per):
        out.append(((r, min(r + per, hi)), *box[1:]))
    return out


class Plan:
    """The static routing plan (see the module docstring)."""

    def __init__(
        self,
        trainers: Sequence[int],
        inference: Sequence[int],
        sources: Mapping[str, SourceParam],
        tasks: list[Task],
        groups: list[Group],
        writes: npt.NDArray[np.int64],
        dst_sizes: Sequence[int],
        header_bytes: int,
    ) -> None:
        self.trainers = tuple(trainers)
        self.inference = tuple(inference)
        self.sources = dict(sources)
        self.tasks = tasks
        self.groups = groups
        self.writes = writes  # int64 [n, 5]: task, inference index, src, dst, length
        self.dst_sizes = tuple(dst_sizes)
        self.header_bytes = header_bytes

    # ---- questions ----

    def trainer_slot(self, rank: int) -> int:
        """The header slot of training rank ``rank`` (its index among the trainers)."""
        return self.trainers.index(rank)

    def tasks_of(self, rank: int) -> list[Task]:
        return [t for t in self.tasks if t.sender == rank]

    def writes_of(self, task: Task) -> npt.NDArray[np.int64]:
        return self.writes[task.first_write : task.first_write + task.n_writes]

    def sent_bytes(self) -> dict[int, int]:
        """Bytes each training rank writes per update."""
        per_task = np.bincount(self.writes[:, 0], weights=self.writes[:, 4], minlength=len(self.tasks))
        out = dict.fromkeys(self.trainers, 0)
        for t in self.tasks:
            out[t.sender] += int(per_task[t.index])
        return out

    def arrivals(self, rank: int) -> int:
        """Immediates inference rank ``rank`` counts in one update: one per write to it,
        plus a begin and a done version word from every trainer."""
        i = self.inference.index(rank)
        return int(np.count_nonzero(self.writes[:, 1] == i)) + 2 * len(self.trainers)

    def received_bytes(self) -> dict[int, int]:
        """Bytes each inference rank receives per update."""
        per = np.bincount(self.writes[:, 1], weights=self.writes[:, 4], minlength=len(self.inference))
        return {r: int(per[i]) for i, r in enumerate(self.inference)}

    def unique_bytes(self) -> int:
        """Bytes of all staged slices (each converted slice once, however many ranks get it)."""
        return sum(t.nbytes for t in self.tasks)

    def total_bytes(self) -> int:
        return int(self.writes[:, 4].sum())

    def check_coverage(self, layouts: Sequence[RankLayout]) -> None:
        """Raise unless every byte of every destination tensor (and fp8 scale) is written
        exactly once and nothing else is written."""
        if len(layouts) != len(self.inference):
            raise InvalidArgument(f"{len(layouts)} layouts for {len(self.inference)} inference ranks")
        for i, lay in enumerate(layouts):
            rows = self.writes[self.writes[:, 1] == i]
            order = np.argsort(rows[:, 3], kind="stable")
            got = _merge(rows[order, 3], rows[order, 4], f"inference rank {i}")
            want_s, want_l = [], []
            for t in lay.tensors:
                slot = lay.slots[t.name]
                want_s.append(slot.offset)
                want_l.append(t.nbytes)
                if t.fp8:
                    want_s.append(slot.scale_offset)
                    want_l.append(t.scale_nbytes)
            o = np.argsort(np.array(want_s, dtype=np.int64), kind="stable")
            want = _merge(np.array(want_s, dtype=np.int64)[o], np.array(want_l, dtype=np.int64)[o], "layout")
            if got != want:
                raise InvalidArgument(
                    f"inference rank {i}: writes cover {got[:4]}..., tensors are {want[:4]}..."
                )

    # ---- serialization ----

    def to_bytes(self) -> bytes:
        meta = {
            "trainers": self.trainers,
            "inference": self.inference,
            "dst_sizes": self.dst_sizes,
            "header_bytes": self.header_bytes,
            "sources": [
                [s.name, s.shape, s.dtype, s.mesh_shape, s.mesh_ranks, [p.dim for p in s.placements]]
                for s in self.sources.values()
            ],
            "tasks": [
                [
                    t.param,
                    t.box,
                    t.out_dtype,
                    t.block,
                    t.sender,
                    t.unshard,
                    t.group,
                    t.first_write,
                    t.n_writes,
                ]
                for t in self.tasks
            ],
            "groups": [[g.key, g.mesh_ranks, g.unshard, g.first_task, g.n_tasks] for g in self.groups],
        }
        buf = io.BytesIO()
        raw = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        np.savez(buf, writes=self.writes, meta=raw)
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Plan:
        """Decode what :meth:`to_bytes` made, which may have come from a peer: every field
        is checked (its type, its range, every index and byte range against what it
        refers to) and sizes declared inside against the bytes present, before anything
        is allocated for them. Raises :class:`InvalidArgument` and nothing else."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"not a weight transfer plan: {type(blob).__name__}, not bytes")
        try:
            arrays = read_members(bytes(blob), _MEMBERS)
            meta = json.loads(arrays["meta"].tobytes().decode())
            return _decode(arrays["writes"], meta)
        except InvalidArgument as e:
            raise InvalidArgument(f"not a weight transfer plan: {e}") from e
        except _MALFORMED as e:
            raise InvalidArgument(f"not a weight transfer plan: {type(e).__name__}: {e}") from e

    def summary(self) -> dict[str, Any]:
        sent, recv = self.sent_bytes(), self.received_bytes()
        return {
            "tasks": len(self.tasks),
            "writes": int(self.writes.shape[0]),
            "total_bytes": self.total_bytes(),
            "unique_bytes": self.unique_bytes(),
            "max_sent": max(sent.values(), default=0),
            "mean_sent": sum(sent.values()) / max(1, len(sent)),
            "max_received": max(recv.values(), default=0),
            "unshard_params": sum(len(g.unshard) for g in self.groups),
        }


# ---- decoding ----

_MEMBERS: dict[str, tuple[np.dtype[Any], int]] = {"writes": (np.dtype("<i8"), 2), "meta": (np.dtype("u1"), 1)}
_MALFORMED = (
    ValueError, TypeError, KeyError, IndexError, OverflowError, EOFError, OSError, MemoryError,
    RuntimeError, struct.error, zipfile.BadZipFile, zipfile.LargeZipFile,
)  # fmt: skip
"""What zipfile, numpy's header parser and json raise for malformed bytes (RuntimeError:
zipfile's NotImplementedError for an unknown zip version, json's RecursionError)."""
_META_KEYS = {"trainers", "inference", "dst_sizes", "header_bytes", "sources", "tasks", "groups"}
_BIG = 1 << 62
"""The largest size, offset or rank a plan holds: two of them add up exactly in int64."""
_MAX_DIMS = 64


def _int(v: object, what: str, lo: int = 0, hi: int = _BIG) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise InvalidArgument(f"{what}: {v!r:.40} is not an integer in {lo}..{hi}")
    return v


def _list(v: object, what: str, n: int | None = None) -> list[Any]:
    if not isinstance(v, list) or (n is not None and len(v) != n):
        raise InvalidArgument(f"{what}: {v!r:.40} is not a list" + ("" if n is None else f" of {n}"))
    return v


def _str(v: object, what: str) -> str:
    if not isinstance(v, str):
        raise InvalidArgument(f"{what}: {v!r:.40} is not a string")
    return v


def _ranks(v: object, what: str, at_least: int = 0) -> list[int]:
    ranks = [_int(r, what) for r in _list(v, what)]
    if len(set(ranks)) != len(ranks) or len(ranks) < at_least:
        raise InvalidArgument(f"{what}: {len(ranks)} ranks, not {at_least} or more distinct ones")
    return ranks


def _source(v: object, trainers: set[int]) -> SourceParam:
    from .meta import Placement

    name, shape, dtype, mesh_shape, mesh_ranks, dims = _list(v, "source", 6)
    name = _str(name, "source name")
    shape = tuple(_int(n, f"{name}: shape") for n in _list(shape, f"{name}: shape"))
    mesh_shape = tuple(_int(n, f"{name}: mesh shape", 1) for n in _list(mesh_shape, f"{name}: mesh shape"))
    if len(shape) > _MAX_DIMS or len(mesh_shape) > _MAX_DIMS:
        raise InvalidArgument(f"{name}: more than {_MAX_DIMS} dimensions")
    placements = tuple(
        Placement(None if d is None else _int(d, f"{name}: placement", 0, len(shape) - 1))
        for d in _list(dims, f"{name}: placements")
    )
    src = SourceParam(
        name, shape, _str(dtype, f"{name}: dtype"), mesh_shape, tuple(_ranks(mesh_ranks, f"{name}: mesh")),
        placements,
    )  # fmt: skip
    if not set(src.mesh_ranks) <= trainers:
        stray = sorted(set(src.mesh_ranks) - trainers)
        raise InvalidArgument(f"{name}: mesh ranks {stray[:8]} are not trainers")
    if src.nbytes > _BIG:
        raise InvalidArgument(f"{name}: {src.nbytes} bytes")
    return src


def _box(v: object, shape: tuple[int, ...], what: str) -> Box:
    out = []
    for d, pair in enumerate(_list(v, f"{what}: box", len(shape))):
        lo, hi = _list(pair, f"{what}: box", 2)
        lo = _int(lo, f"{what}: box start", 0, shape[d] - 1)
        out.append((lo, _int(hi, f"{what}: box stop", lo + 1, shape[d])))
    return tuple(out)


def _task(index: int, v: object, sources: Mapping[str, SourceParam], n_groups: int) -> Task:
    param, box, out_dtype, block, sender, unshard, group, first, n = _list(v, "task", 9)
    what = f"task {index}"
    src = sources.get(_str(param, f"{what}: parameter"))
    if src is None:
        raise InvalidArgument(f"{what}: no parameter named {param!r:.40}")
    if not isinstance(unshard, bool):
        raise InvalidArgument(f"{what}: unshard {unshard!r:.40} is not a boolean")
    t = Task(
        index, param, _box(box, src.shape, what), _str(out_dtype, f"{what}: dtype"),
        _int(block, f"{what}: block"), _int(sender, f"{what}: sender"), unshard,
        _int(group, f"{what}: group", 0, n_groups - 1),
        _int(first, f"{what}: first write"), _int(n, f"{what}: writes"),
    )  # fmt: skip
    dtype_size(t.out_dtype)
    if (t.out_dtype == FP8) != t.fp8 or (t.fp8 and len(t.box) != 2):
        raise InvalidArgument(f"{what}: {t.out_dtype} with block {t.block} of a {len(t.box)}-d slice")
    if t.sender not in src.mesh_ranks:
        raise InvalidArgument(f"{what}: sender {t.sender} is not in {param}'s mesh")
    if not unshard and any(
        not a <= lo < hi <= b for (lo, hi), (a, b) in zip(t.box, src.box_of(t.sender), strict=True)
    ):
        raise InvalidArgument(f"{what}: rank {t.sender} does not hold slice {t.box} of {param}")
    if t.nbytes > _BIG:
        raise InvalidArgument(f"{what}: {t.nbytes} staging bytes")
    return t


def _group(index: int, v: object, sources: Mapping[str, SourceParam], trainers: set[int]) -> Group:
    key, mesh, unshard, first, n = _list(v, "group", 5)
    what = f"group {index}"
    g = Group(
        _str(key, f"{what}: key"), tuple(_ranks(mesh, f"{what}: mesh")),
        tuple(_str(p, f"{what}: parameter") for p in _list(unshard, f"{what}: unshard")),
        _int(first, f"{what}: first task"), _int(n, f"{what}: tasks"),
    )  # fmt: skip
    if not set(g.mesh_ranks) <= trainers or not set(g.unshard) <= set(sources):
        raise InvalidArgument(f"{what}: a mesh rank that is no trainer, or a parameter the plan lacks")
    return g


def _tiles(spans: Sequence[tuple[int, int]], total: int, what: str) -> None:
    """Spans ``(first, count)`` must follow one another from 0 and end at ``total``."""
    at = 0
    for first, n in spans:
        if first != at:
            raise InvalidArgument(f"{what}: a span starts at {first}, the previous ended at {at}")
        at += n
    if at != total:
        raise InvalidArgument(f"{what}: spans cover {at} of {total}")


def _check_writes(
    writes: npt.NDArray[np.int64], tasks: Sequence[Task], dst_sizes: Sequence[int], header: int
) -> None:
    """Each row belongs to the task whose span holds it, names an inference rank, and reads
    inside its task's staging bytes and writes inside its rank's buffer, past the header."""
    if writes.shape[1] != 5:
        raise InvalidArgument(f"writes of shape {writes.shape}, expected (n, 5)")
    owner = np.repeat(np.arange(len(tasks), dtype=np.int64), [t.n_writes for t in tasks])
    task, rank, src, dst, n = writes.T
    if not np.array_equal(task, owner):
        raise InvalidArgument("a write names another task than the one whose span holds it")
    if ((rank < 0) | (rank >= len(dst_sizes))).any():
        raise InvalidArgument("a write to an inference rank the plan does not list")
    if ((src < 0) | (n < 0) | (dst < header)).any():
        raise InvalidArgument("a write with a negative offset or length, or into the version header")
    staged = np.array([t.nbytes for t in tasks], dtype=np.int64)[task]
    sizes = np.array(dst_sizes, dtype=np.int64)[rank]
    if ((src > staged) | (n > staged - src) | (dst > sizes) | (n > sizes - dst)).any():
        raise InvalidArgument("a write outside its task's staging bytes or its rank's buffer")


def _decode(writes: npt.NDArray[np.int64], meta: object) -> Plan:
    if not isinstance(meta, dict):
        raise InvalidArgument(f"metadata {meta!r:.40} is not an object")
    if set(meta) != _META_KEYS:
        raise InvalidArgument(f"metadata fields {sorted(meta)[:10]}, expected {sorted(_META_KEYS)}")
    trainers = _ranks(meta["trainers"], "trainers", 1)
    inference = _ranks(meta["inference"], "inference ranks")
    sizes = [_int(n, "buffer size") for n in _list(meta["dst_sizes"], "buffer sizes", len(inference))]
    header = _int(meta["header_bytes"], "header bytes", 16 * len(trainers), 16 * len(trainers))
    if any(n < header for n in sizes):
        raise InvalidArgument(f"a buffer smaller than the {header}-byte header")
    sources: dict[str, SourceParam] = {}
    for v in _list(meta["sources"], "sources"):
        s = _source(v, set(trainers))
        if sources.setdefault(s.name, s) is not s:
            raise InvalidArgument(f"parameter {s.name} twice")
    raw_groups = _list(meta["groups"], "groups")
    tasks = [_task(i, v, sources, len(raw_groups)) for i, v in enumerate(_list(meta["tasks"], "tasks"))]
    groups = [_group(i, v, sources, set(trainers)) for i, v in enumerate(raw_groups)]
    _tiles([(t.first_write, t.n_writes) for t in tasks], writes.shape[0], "tasks' writes")
    _tiles([(g.first_task, g.n_tasks) for g in groups], len(tasks), "groups' tasks")
    for gi, g in enumerate(groups):
        if any(t.group != gi for t in tasks[g.first_task : g.first_task + g.n_tasks]):
            raise InvalidArgument(f"group {gi}: holds a task of another group")
    _check_writes(writes, tasks, sizes, header)
    return Plan(trainers, inference, sources, tasks, groups, writes, sizes, header)


def _merge(starts: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], what: str) -> list[tuple[int, int]]:
    """Sorted ranges merged into maximal runs; raises on an overlap."""
    out: list[tuple[int, int]] = []
    for s, n in zip(starts.tolist(), lengths.tolist(), strict=True):
        if n <= 0:
            continue
        if out and s < out[-1][1]:
            raise InvalidArgument(f"{what}: byte {s} is covered twice")
        if out and s == out[-1][1]:
            out[-1] = (out[-1][0], s + n)
        else:
            out.append((s, s + n))
    return out


# ---- building ----


def _pieces(sources: Mapping[str, SourceParam], layouts: Sequence[RankLayout]) -> dict[str, list[_Piece]]:
    """Destination slices by source parameter, each listing the ranks and offsets wanting it."""
    found: dict[tuple[str, Box, str, int], _Piece] = {}
    for i, lay in enumerate(layouts):
        for t in lay.tensors:
            _check_tensor(t, sources)
            slot = lay.slots[t.name]
            row_bytes = math.prod(t.shape[1:]) * dtype_size(t.dtype)
            scale_row_bytes = 4 * t.scale_shape[1] if t.fp8 else 0
            rows = 0
            for part in t.parts:
                block = t.block if t.fp8 else 0
                key = (part.source, part.box, t.dtype, block)
                piece = found.setdefault(key, _Piece(part.source, part.box, t.dtype, block))
                scale = slot.scale_offset + (rows // t.block) * scale_row_bytes if t.fp8 else -1
                piece.dests.append((i, slot.offset + rows * row_bytes, scale))
                rows += box_shape(part.box)[0]
    by_param: dict[str, list[_Piece]] = defaultdict(list)
    for piece in found.values():
        by_param[piece.param].append(piece)
    return by_param


def _check_tensor(t: DestTensor, sources: Mapping[str, SourceParam]) -> None:
    for part in t.parts:
        src = sources.get(part.source)
        if src is None:
            raise InvalidArgument(f"{t.name}: no training parameter named {part.source!r}")
        if len(part.box) != len(src.shape) or any(
            not 0 <= lo < hi <= n for (lo, hi), n in zip(part.box, src.shape, strict=True)
        ):
            raise InvalidArgument(f"{t.name}: slice {part.box} is outside {part.source}{list(src.shape)}")
        if t.fp8 and len(src.shape) != 2:
            raise InvalidArgument(f"{t.name}: fp8 needs a 2-d source, {part.source} is {len(src.shape)}-d")


def replica_sets(src: SourceParam) -> list[tuple[Box, list[int]]]:
    """Distinct non-empty shard boxes and the ranks holding each."""
    sets: dict[Box, list[int]] = {}
    for rank, box in src.holders():
        if box_numel(box) > 0:
            sets.setdefault(box, []).append(rank)
    return list(sets.items())


def _direct_bands(src: SourceParam, piece: _Piece, opts: PlanOptions) -> list[tuple[Box, list[int]]] | None:
    """Bands of ``piece`` each inside one shard, with the ranks holding it; None when the
    shards do not suit (an fp8 tile crosses a shard edge, or slices would be tiny)."""
    elt = dtype_size(piece.out_dtype)
    out: list[tuple[Box, list[int]]] = []
    for box, ranks in replica_sets(src):
        inter = intersect(piece.box, box)
        if inter is None:
            continue
        nbytes = box_numel(inter) * elt
        if piece.block:
            (p0, p1), (c0, c1) = piece.box
            (r0, r1), (i0, i1) = inter
            if (i0, i1) != (c0, c1) or (r0 - p0) % piece.block or (r1 != p1 and (r1 - p0) % piece.block):
                return None
            multiple = piece.block
        else:
            tiny = nbytes < opts.direct_min_bytes and inter != piece.box
            if src.sharded and tiny and opts.unshard != "never":
                return None
            multiple = 1
        sent = nbytes * len(piece.dests)
        n = max(-(-sent // opts.max_task_bytes), min(len(ranks), max(1, nbytes // opts.direct_min_bytes)))
        out.extend((band, ranks) for band in _row_bands(inter, n, multiple))
    return out


def _writes_for(piece: _Piece, band: Box) -> list[tuple[int, int, int, int]]:
    """``(inference idx, src, dst, length)`` for one band of a piece, to every destination."""
    out: list[tuple[int, int, int, int]] = []
    if piece.block:
        (p0, _), (c0, c1) = piece.box
        r0, r1 = band[0]
        cols = c1 - c0
        scols = -(-cols // piece.block)
        data = (r1 - r0) * cols
        sc_src = -(-data // STAGE_ALIGN) * STAGE_ALIGN
        sc_len = 4 * scols * (-(-(r1 - r0) // piece.block))
        for i, d_off, s_off in piece.dests:
            out.append((i, 0, d_off + (r0 - p0) * cols, data))
            out.append((i, sc_src, s_off + ((r0 - p0) // piece.block) * scols * 4, sc_len))
        return out
    segs = copy_segments(piece.box, band, dtype_size(piece.out_dtype))
    for i, d_off, _ in piece.dests:
        out.extend((i, s, d_off + d, n) for s, d, n in segs)
    return out


_Raw = tuple[str, str, Box, list[int], bool, _Piece]
"""A slice before assignment: (group key, param, band, ranks able to send it, unshard, piece)."""


def _check_inputs(
    srcs: Mapping[str, SourceParam], layouts: Sequence[RankLayout], trainers: list[int], inference: list[int]
) -> None:
    if len(inference) != len(layouts):
        raise InvalidArgument(f"{len(layouts)} layouts for {len(inference)} inference ranks")
    if not trainers or len(set(trainers)) != len(trainers):
        raise InvalidArgument("trainers must be distinct ranks, at least one")
    for lay in layouts:
        if lay.trainers != len(trainers):
            raise InvalidArgument(f"a layout has {lay.trainers} header slots for {len(trainers)} trainers")
    for s in srcs.values():
        stray = set(s.mesh_ranks) - set(trainers)
        if stray:
            raise InvalidArgument(f"{s.name}: mesh ranks {sorted(stray)} are not trainers")


def _slices_of(src: SourceParam, pieces: list[_Piece], opts: PlanOptions) -> tuple[list[_Raw], bool]:
    """A parameter's slices, and whether it must be unsharded: straight from the shards
    when every destination slice suits them, else cut from the whole parameter."""
    gkey = f"{list(src.mesh_shape)}:{list(src.mesh_ranks)}:{[str(p) for p in src.placements]}"
    direct: list[list[tuple[Box, list[int]]]] = []
    need = opts.unshard == "always" and src.sharded
    for piece in [] if need else pieces:
        bands = _direct_bands(src, piece, opts)
        if bands is None:
            need = src.sharded  # whole everywhere: any holder can cut any slice
            if not need:
                bands = _direct_bands(src, piece, replace(opts, unshard="never"))
                assert bands is not None
            else:
                break
        direct.append(bands)
    if not need:
        return [
            (gkey, src.name, b, r, False, p)
            for p, bands in zip(pieces, direct, strict=True)
            for b, r in bands
        ], False
    if opts.unshard == "never":
        raise InvalidArgument(
            f"{src.name}: a destination needs data across shards of {src.placements} "
            "(fp8 tiles or slices crossing shard edges): allow unshard"
        )
    out: list[_Raw] = []
    for piece in pieces:
        # cut by bytes sent, so a slice many ranks want is spread over several senders
        nbytes = box_numel(piece.box) * dtype_size(piece.out_dtype) * len(piece.dests)
        n = max(1, -(-nbytes // opts.max_task_bytes))
        out.extend(
            (gkey, src.name, b, list(src.mesh_ranks), True, piece)
            for b in _row_bands(piece.box, n, piece.block or 1)
        )
    return out, True


def _load(r: _Raw) -> int:
    return box_numel(r[2]) * dtype_size(r[5].out_dtype) * len(r[5].dests)


def _assign(raw: list[_Raw], trainers: list[int]) -> list[int]:
    """The sender of every slice: slices only one rank holds first, then the others
    largest first, each onto the least-loaded rank that can prepare it."""
    load = dict.fromkeys(trainers, 0)
    sender = [0] * len(raw)
    for k in sorted(range(len(raw)), key=lambda k: (len(raw[k][3]) > 1, -_load(raw[k]))):
        best = min(raw[k][3], key=lambda r: (load[r], r))
        sender[k] = best
        load[best] += _load(raw[k])
    return sender


def build_plan(
    sources: Mapping[str, SourceParam] | Sequence[SourceParam],
    layouts: Sequence[RankLayout],
    *,
    trainers: Sequence[int],
    inference: Sequence[int] | None = None,
    options: PlanOptions | None = None,
) -> Plan:
    """Plan the transfer from training parameters to inference ranks' tensors.

    Args:
        sources: the training parameters (shape, dtype, mesh and placements).
        layouts: one per inference rank: the tensors it holds.
        trainers: the training ranks (global ranks).
        inference: the inference ranks (default: the ranks after ``trainers``).
        options: task size, what is sent straight and what is unsharded.

    Returns:
        The plan: every trainer's tasks and every write's target, offset and length.

    Raises:
        InvalidArgument: a destination tensor no source covers, slices outside their
            source, or not one layout per inference rank.
    """
    opts = options or PlanOptions()
    opts.check()
    srcs = dict(sources) if isinstance(sources, Mapping) else {s.name: s for s in sources}
    tr = list(trainers)
    inf = list(inference) if inference is not None else list(range(len(tr), len(tr) + len(layouts)))
    _check_inputs(srcs, layouts, tr, inf)
    pieces = _pieces(srcs, layouts)
    raw: list[_Raw] = []
    unshard_params: set[str] = set()
    for name in sorted(pieces):
        slices, unshard = _slices_of(srcs[name], pieces[name], opts)
        raw.extend(slices)
        if unshard:
            unshard_params.add(name)
    sender = _assign(raw, tr)
    by_group: dict[str, list[int]] = defaultdict(list)
    for k, r in enumerate(raw):
        by_group[r[0]].append(k)
    tasks: list[Task] = []
    groups: list[Group] = []
    rows: list[tuple[int, int, int, int, int]] = []
    for gi, gkey in enumerate(sorted(by_group)):
        members = sorted(by_group[gkey], key=lambda k: (raw[k][1], raw[k][2]))
        first = len(tasks)
        for k in members:
            _g, name, band, _r, unshard, piece = raw[k]
            ws = _writes_for(piece, band)
            t = Task(
                len(tasks),
                name,
                band,
                piece.out_dtype,
                piece.block,
                sender[k],
                unshard,
                gi,
                len(rows),
                len(ws),
            )
            rows.extend((t.index, i, s, d, n) for i, s, d, n in ws)
            tasks.append(t)
        mesh = srcs[raw[members[0]][1]].mesh_ranks
        order_params = tuple(dict.fromkeys(raw[k][1] for k in members if raw[k][1] in unshard_params))
        groups.append(Group(gkey, mesh, order_params, first, len(tasks) - first))
    writes = np.array(rows, dtype=np.int64).reshape(-1, 5)
    header = layouts[0].header_bytes if layouts else 16 * len(tr)
    used = {n: srcs[n] for n in pieces}
    return Plan(tr, inf, used, tasks, groups, writes, [lay.nbytes for lay in layouts], header)
