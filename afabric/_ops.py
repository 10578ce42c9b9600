"""An operation in flight, as the facade tracks it (shared by engine.py and _messaging.py).

A plain tuple, ``(future, verb, peer, refs, kind)``: one is made per operation, and a tuple
costs a third of a slotted object's ``__init__`` (docs/internals/architecture.md). The
future resolves the caller's await; verb and peer name the operation in errors; refs keep
what the operation uses alive until it completes; kind is "write", "read", "send" or
"expect"."""

from __future__ import annotations

import asyncio
from typing import Any

Op = tuple["asyncio.Future[None]", str, int, tuple[Any, ...], str]


def op_label(op: Op) -> str:
    _, verb, peer, _, kind = op
    where = "from" if kind == "read" else "to"
    return f"{verb} {where} peer {peer:016x}" if peer else verb
