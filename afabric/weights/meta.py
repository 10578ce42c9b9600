"""Parameter metadata: which training rank holds which slice of a parameter.

A slice is a :data:`Box` (``(start, stop)`` per dimension, in the parameter's global
coordinates). :class:`SourceParam` describes a parameter sharded over a device mesh the way
torch DTensor placements do (``Shard(dim)`` splits with ``torch.chunk`` semantics, so shards
may be uneven or empty; ``Replicate()`` copies; mesh dimensions apply in order, so two
shardings of one dimension nest). Everything here is plain data: it is gathered from every
rank, planned on one and shipped to all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..errors import InvalidArgument

Box = tuple[tuple[int, int], ...]
"""``(start, stop)`` per dimension, global coordinates."""

DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
}
"""Element sizes of the dtypes weights travel in (names as torch spells them)."""


def dtype_size(name: str) -> int:
    try:
        return DTYPE_SIZES[name]
    except KeyError:
        raise InvalidArgument(f"unsupported weight dtype {name!r} (one of {sorted(DTYPE_SIZES)})") from None


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def box_numel(box: Box) -> int:
    return math.prod(box_shape(box))


def full_box(shape: tuple[int, ...]) -> Box:
    return tuple((0, n) for n in shape)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes, or None when it is empty."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def chunk_range(lo: int, hi: int, parts: int, index: int) -> tuple[int, int]:
    """Piece ``index`` of ``[lo, hi)`` split in ``parts`` as ``torch.chunk`` (and so DTensor's
    ``Shard``) splits it: pieces of ``ceil(n / parts)``, the last ones shorter or empty."""
    n = hi - lo
    size = -(-n // parts) if n else 0
    start = min(lo + index * size, hi)
    return start, min(start + size, hi)


@dataclass(frozen=True)
class Placement:
    """One mesh dimension's placement: ``Shard(dim)`` (``dim`` >= 0) or ``Replicate()``
    (``dim`` is None)."""

    dim: int | None = None

    def __str__(self) -> str:
        return "Replicate()" if self.dim is None else f"Shard({self.dim})"


@dataclass(frozen=True)
class SourceParam:
    """A training-side parameter: global shape and dtype, and how it is spread over the
    training ranks (``mesh``: the ranks of the device mesh as nested tuples, row-major, as
    ``DeviceMesh.mesh.tolist()``; ``placements``: one per mesh dimension). A parameter held
    whole by one rank has ``mesh=(rank,)`` and ``placements=(Placement(),)``."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    mesh_shape: tuple[int, ...]
    mesh_ranks: tuple[int, ...]  # flattened, row-major
    placements: tuple[Placement, ...]

    def __post_init__(self) -> None:
        dtype_size(self.dtype)
        if len(self.placements) != len(self.mesh_shape):
            raise InvalidArgument(
                f"{self.name}: {len(self.placements)} placements for a {len(self.mesh_shape)}-d mesh"
            )
        if any(n < 1 for n in self.mesh_shape):
            raise InvalidArgument(f"{self.name}: mesh shape {self.mesh_shape} has an empty dimension")
        if math.prod(self.mesh_shape) != len(self.mesh_ranks):
            raise InvalidArgument(
                f"{self.name}: mesh shape {self.mesh_shape} does not match {len(self.mesh_ranks)} ranks"
            )
        if len(set(self.mesh_ranks)) != len(self.mesh_ranks):
            raise InvalidArgument(f"{self.name}: a rank appears twice in the mesh")
        for p in self.placements:
            if p.dim is not None and not 0 <= p.dim < len(self.shape):
                raise InvalidArgument(f"{self.name}: {p} of a {len(self.shape)}-d parameter")
        if any(n < 0 for n in self.shape):
            raise InvalidArgument(f"{self.name}: negative dimension in {self.shape}")

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)

    @property
    def sharded(self) -> bool:
        """Whether some rank holds less than the whole parameter."""
        return any(p.dim is not None and n > 1 for p, n in zip(self.placements, self.mesh_shape, strict=True))

    def coordinate(self, index: int) -> tuple[int, ...]:
        coord = []
        for n in reversed(self.mesh_shape):
            coord.append(index % n)
            index //= n
        return tuple(reversed(coord))

    def box_at(self, coord: tuple[int, ...]) -> Box:
        """The slice the rank at mesh coordinate ``coord`` holds (may be empty)."""
        box = [[0, n] for n in self.shape]
        for p, size, c in zip(self.placements, self.mesh_shape, coord, strict=True):
            if p.dim is not None:
                lo, hi = box[p.dim]
                box[p.dim] = list(chunk_range(lo, hi, size, c))
        return tuple((a, b) for a, b in box)

    def holders(self) -> list[tuple[int, Box]]:
        """``(rank, box)`` for every rank of the mesh, in mesh order."""
        return [(r, self.box_at(self.coordinate(i))) for i, r in enumerate(self.mesh_ranks)]

    def box_of(self, rank: int) -> Box:
        try:
            i = self.mesh_ranks.index(rank)
        except ValueError:
            raise InvalidArgument(f"{self.name}: rank {rank} is not in its mesh {self.mesh_ranks}") from None
        return self.box_at(self.coordinate(i))


@dataclass(frozen=True)
class LocalShard:
    """A training rank's shard held outside DTensor (e.g. a framework's own sharding, or
    tensors on a device DTensor's process group cannot serve), with the metadata saying
    which slice it is. Such parameters are sent straight from the shards; a plan that would
    need to unshard them is refused (plan with ``unshard="never"``)."""

    tensor: Any
    meta: SourceParam


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def source_of(name: str, tensor: Any, *, rank: int | None = None) -> SourceParam:
    """Metadata of a training parameter: a DTensor (its mesh and placements, ranks of the
    mesh as given by ``DeviceMesh.mesh``), a :class:`LocalShard`, or a plain tensor held
    whole by ``rank``.
    Ranks are the process-group ranks the transfer session uses."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if isinstance(tensor, LocalShard):
        if tensor.meta.name != name:
            raise InvalidArgument(f"{name}: its LocalShard describes {tensor.meta.name}")
        return tensor.meta
    if isinstance(tensor, DTensor):
        mesh = tensor.device_mesh
        placements = []
        for p in tensor.placements:
            if type(p) is Shard:
                placements.append(Placement(int(p.dim)))
            elif isinstance(p, Replicate):
                placements.append(Placement())
            else:
                raise InvalidArgument(
                    f"{name}: placement {p} cannot be transferred (only Shard(dim) and Replicate(); "
                    "a Partial tensor must be reduced first)"
                )
        ranks = tuple(int(r) for r in mesh.mesh.flatten().tolist())
        return SourceParam(
            name, tuple(int(n) for n in tensor.shape), _dtype_name(tensor.dtype),
            tuple(int(n) for n in mesh.mesh.shape), ranks, tuple(placements),
        )  # fmt: skip
    if rank is None:
        raise InvalidArgument(f"{name}: a plain tensor needs the rank that holds it")
    return SourceParam(
        name, tuple(int(n) for n in tensor.shape), _dtype_name(tensor.dtype), (1,), (rank,), (Placement(),)
    )
