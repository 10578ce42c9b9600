"""The inference side: one registered buffer holding every tensor of this rank, written by
the training ranks; the inference process does nothing during an update.

The buffer starts with version words, two per training rank: ``begin`` (written before
that rank's first write of an update) and ``done`` (written once all its writes
completed). The weights are whole for version v only if every begin and done word is v;
a rank that died mid-update leaves its ``done`` behind, which :meth:`Receiver.version`
and :meth:`Receiver.check` see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import AfabricError, InvalidArgument
from .layout import DestTensor, RankLayout
from .prepare import torch_dtype

if TYPE_CHECKING:
    from ..engine import Engine
    from ..memory import MemoryRegion


class WeightUpdateFailed(AfabricError):
    """An update did not complete on every rank: a rank died or stalled, a write failed, or
    the version words show half-written weights. The weights of this update must not be used."""


class Receiver:
    """This inference rank's weights, registered for the training ranks to write into."""

    def __init__(self, engine: Engine, tensors: list[DestTensor] | tuple[DestTensor, ...], trainers: int,
                 device: str = "cpu") -> None:  # fmt: skip
        import torch

        self.layout = RankLayout(tensors, trainers)
        dev = torch.device(device)
        self.buffer = torch.zeros(self.layout.nbytes, dtype=torch.uint8, device=dev)
        self.mr: MemoryRegion = engine.register(self.buffer)
        self.imm = engine.alloc_imm()
        """Every write of an update carries this immediate: the shim counts arrivals, and the
        update is in place once the plan's count for this rank has arrived."""
        self.tensors: dict[str, Any] = {}
        """Destination tensors by name (views of the buffer); fp8 scales as ``<name>.scale``."""
        for t in self.layout.tensors:
            slot = self.layout.slots[t.name]
            raw = self.buffer[slot.offset : slot.offset + t.nbytes]
            self.tensors[t.name] = raw.view(torch_dtype(t.dtype)).view(t.shape)
            if t.fp8:
                sraw = self.buffer[slot.scale_offset : slot.scale_offset + t.scale_nbytes]
                self.tensors[t.name + ".scale"] = sraw.view(torch.float32).view(t.scale_shape)
        self._words = self.buffer[: self.layout.header_bytes].view(torch.int64)

    def words(self) -> list[tuple[int, int]]:
        """``(begin, done)`` version words of every training rank."""
        w = self._words.cpu().tolist()
        return [(w[2 * i], w[2 * i + 1]) for i in range(self.layout.trainers)]

    def version(self) -> int | None:
        """The version the weights are whole for, or None while any rank's writes are
        missing (an update in progress, or one that failed)."""
        words = self.words()
        v = words[0][0]
        return v if all(b == v and d == v for b, d in words) else None

    def check(self, version: int) -> None:
        """Raise :class:`WeightUpdateFailed` unless the weights are whole for ``version``,
        naming the training ranks whose writes are missing."""
        bad = [(i, b, d) for i, (b, d) in enumerate(self.words()) if b != version or d != version]
        if bad:
            shown = ", ".join(f"trainer {i} (begin {b}, done {d})" for i, b, d in bad[:8])
            raise WeightUpdateFailed(f"weights are not whole for version {version}: {shown}")

    def set_version(self, version: int) -> None:
        """Mark every rank's words (the rank-0 baseline writes the buffer locally)."""
        if version < 0:
            raise InvalidArgument("versions are non-negative")
        self._words.fill_(version)
