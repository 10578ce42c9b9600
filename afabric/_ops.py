"""An operation in flight, as the facade tracks it (shared by engine.py and _messaging.py)."""

from __future__ import annotations

import asyncio
from typing import Any


class _Op:
    """An operation in flight: its future, how to name it in errors, what it keeps alive."""

    __slots__ = ("future", "kind", "peer", "refs", "verb")

    def __init__(
        self, future: asyncio.Future[None], verb: str, peer: int, refs: tuple[Any, ...], kind: str
    ) -> None:
        self.future = future
        self.verb = verb
        self.peer = peer
        self.refs = refs
        self.kind = kind

    def label(self) -> str:
        where = "from" if self.kind == "read" else "to"
        return f"{self.verb} {where} peer {self.peer:016x}" if self.peer else self.verb
