"""Peer groups, scatter targets and gather sources: one call writes to (reads from) many peers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .address import Address
from .descriptor import MrDesc
from .errors import InvalidArgument


class EngineView(Protocol):
    """What a peer group needs of its engine (:class:`afabric.Engine`, which imports this
    module): declared here so this module stands below the engine."""

    name: str


@dataclass(frozen=True)
class ScatterTarget:
    """One write of a scatter: ``length`` bytes from ``src_offset`` of the local region to
    ``dst_offset`` of the region ``desc`` describes."""

    desc: MrDesc
    length: int
    src_offset: int = 0
    dst_offset: int = 0


@dataclass(frozen=True)
class GatherSource:
    """One read of a gather: ``length`` bytes from ``src_offset`` of the region ``desc``
    describes (registered ``remote="r"`` or ``"rw"``) to ``dst_offset`` of the local region."""

    desc: MrDesc
    length: int
    src_offset: int = 0
    dst_offset: int = 0


class PeerGroup:
    """Peers resolved once (address vectors filled, connections started), so scatters and
    barriers to them post without per-peer set-up; also checks that every target of an
    operation given ``group=`` belongs to it."""

    def __init__(self, engine: EngineView, addresses: list[Address], peer_ids: list[int]) -> None:
        self.engine_name = engine.name
        self.addresses = tuple(addresses)
        self._ids = tuple(peer_ids)
        self._incarnations = frozenset(a.incarnation for a in addresses)

    def __len__(self) -> int:
        return len(self.addresses)

    def __contains__(self, item: object) -> bool:
        if isinstance(item, MrDesc):
            return item.incarnation in self._incarnations
        if isinstance(item, Address):
            return item in self.addresses
        return False

    def check(self, descs: list[MrDesc]) -> None:
        for i, d in enumerate(descs):
            if d.incarnation not in self._incarnations:
                raise InvalidArgument(f"target {i}: its region belongs to an engine outside the peer group")

    def __repr__(self) -> str:
        return f"PeerGroup({len(self)} peers)"
