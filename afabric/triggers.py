"""Conditions for triggered operations: the shim posts the operation itself when one holds.

Pass one as ``when=`` to ``write``, ``write_paged``, ``scatter`` or ``barrier``: the
request is built and handed to the shim at once, and its worker posts it the moment the
condition holds — no Python between, say, a model finishing a layer and that layer's KV
pages leaving. Awaiting the call waits for the (fired) operation to complete; cancelling
it before the condition holds disarms it.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _native
from .errors import ImmediateOutOfRange, InvalidArgument

IMM_MAX = 0xFFFFFFFF
U64_MAX = (1 << 64) - 1


@dataclass(frozen=True)
class Trigger:
    """Built by :meth:`afabric.UvmWatcher.reaches` or :func:`imm_count`."""

    kind: int
    a: int
    b: int
    what: str

    def native(self) -> tuple[int, int, int]:
        return (self.kind, self.a, self.b)

    def __str__(self) -> str:
        return self.what


def watcher_reaches(watcher_id: int, value: int, label: str) -> Trigger:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= U64_MAX:
        raise InvalidArgument(f"watcher trigger value must be an int in 0..2**64-1, got {value!r}")
    return Trigger(_native.TRIG_WATCHER, watcher_id, value, f"{label} reaches {value}")


def imm_count(imm: int, count: int) -> Trigger:
    """A trigger for ``when=``: fire once ``count`` arrivals of ``imm`` were counted here.

    The arrivals are consumed, as by ``expect_imm``; arrivals before the call count.

    Args:
        imm: the immediate value.
        count: arrivals to wait for.

    Returns:
        The trigger.

    Raises:
        ImmediateOutOfRange: ``imm`` is outside 0..2**32-1.
        InvalidArgument: ``count`` is not a non-negative int.
    """
    if isinstance(imm, bool) or not isinstance(imm, int) or not 0 <= imm <= IMM_MAX:
        raise ImmediateOutOfRange(f"immediate {imm!r} outside 0..{IMM_MAX}")
    if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= U64_MAX:
        raise InvalidArgument(f"count must be a non-negative int, got {count!r}")
    return Trigger(_native.TRIG_IMM, imm, count, f"{count} arrivals of immediate {imm}")
