"""The one control message of the MoE all-to-all: what each rank tells every other at setup.

Ranks exchange it through the caller's all-gather (torch.distributed, a launcher, ...), so
the bytes come from another process and are parsed strictly: a fixed magic and version,
every length bounded and checked, no trailing bytes. Anything else raises
:class:`ControlMessageError` and nothing is mapped or registered.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from ..errors import AfabricError

MAGIC = b"AFMOE"
VERSION = 1
IPC_HANDLE_LEN = 64  # sizeof(cudaIpcMemHandle_t)
MAX_ADDRESS = 1024
MAX_DESC = 4096
MAX_DESCS = 8
_HEAD = struct.Struct("<5sBHHI16sQ")  # magic, version, rank, world, node, fingerprint, staging bytes


class ControlMessageError(AfabricError, ValueError):
    """A peer's setup message is malformed, or disagrees with this rank's configuration."""


@dataclass(frozen=True)
class PeerInfo:
    """A rank's setup message: where its receive buffers are, for NVLink peers (a CUDA IPC
    handle of its staging allocation) and for proxy peers (engine address and memory
    descriptors of its pinned receive regions)."""

    rank: int
    world: int
    node: int
    fingerprint: bytes
    staging_bytes: int
    ipc_handle: bytes = b""
    address: bytes = b""
    descs: tuple[bytes, ...] = ()

    def __post_init__(self) -> None:
        if not (0 <= self.rank < self.world <= 0xFFFF):
            raise ControlMessageError(f"rank {self.rank} outside 0..{self.world - 1}")
        if not 0 <= self.node <= 0xFFFFFFFF:
            raise ControlMessageError(f"node {self.node} out of range")
        if len(self.fingerprint) != 16:
            raise ControlMessageError("fingerprint must be 16 bytes")
        if not 0 <= self.staging_bytes < 1 << 64:
            raise ControlMessageError("staging size out of range")
        if len(self.ipc_handle) not in (0, IPC_HANDLE_LEN):
            raise ControlMessageError(f"an IPC handle is {IPC_HANDLE_LEN} bytes, got {len(self.ipc_handle)}")
        if len(self.address) > MAX_ADDRESS:
            raise ControlMessageError(f"engine address of {len(self.address)} bytes (max {MAX_ADDRESS})")
        if len(self.descs) > MAX_DESCS or any(not 0 < len(d) <= MAX_DESC for d in self.descs):
            raise ControlMessageError(f"at most {MAX_DESCS} descriptors of 1..{MAX_DESC} bytes")

    def encode(self) -> bytes:
        parts = [
            _HEAD.pack(
                MAGIC, VERSION, self.rank, self.world, self.node, self.fingerprint, self.staging_bytes
            ),
            struct.pack("<B", len(self.ipc_handle)),
            self.ipc_handle,
            struct.pack("<H", len(self.address)),
            self.address,
            struct.pack("<B", len(self.descs)),
        ]
        for d in self.descs:
            parts += [struct.pack("<H", len(d)), d]
        return b"".join(parts)


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        if n > len(self.data) - self.pos:
            raise ControlMessageError(f"setup message truncated in {what}")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u8(self, what: str) -> int:
        return int(self.take(1, what)[0])

    def u16(self, what: str) -> int:
        return int(struct.unpack("<H", self.take(2, what))[0])


def parse(data: bytes | bytearray | memoryview) -> PeerInfo:
    """Decode a setup message; raises :class:`ControlMessageError` on anything malformed."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ControlMessageError(f"setup message must be bytes, got {type(data).__name__}")
    r = _Reader(bytes(data))
    magic, version, rank, world, node, fp, staging = _HEAD.unpack(r.take(_HEAD.size, "header"))
    if magic != MAGIC:
        raise ControlMessageError(f"not an afabric MoE setup message (magic {magic!r})")
    if version != VERSION:
        raise ControlMessageError(f"setup message version {version}, this afabric speaks {VERSION}")
    handle = r.take(r.u8("IPC handle length"), "IPC handle")
    address = r.take(r.u16("address length"), "address")
    n = r.u8("descriptor count")
    if n > MAX_DESCS:
        raise ControlMessageError(f"{n} descriptors (max {MAX_DESCS})")
    descs = tuple(r.take(r.u16("descriptor length"), "descriptor") for _ in range(n))
    if r.pos != len(r.data):
        raise ControlMessageError(f"{len(r.data) - r.pos} trailing bytes after the setup message")
    return PeerInfo(rank, world, node, fp, staging, handle, address, descs)


def check_peers(infos: list[PeerInfo], world: int, fingerprint: bytes, nodes: tuple[int, ...]) -> None:
    """Every rank sent one message, in rank order, for the same configuration."""
    if len(infos) != world:
        raise ControlMessageError(f"{len(infos)} setup messages for a world of {world}")
    for i, p in enumerate(infos):
        if p.rank != i or p.world != world:
            raise ControlMessageError(
                f"message {i} is from rank {p.rank} of {p.world} (expected {i} of {world})"
            )
        if p.fingerprint != fingerprint:
            raise ControlMessageError(f"rank {i} was configured differently (MoeConfig differs)")
        if p.node != nodes[i]:
            raise ControlMessageError(
                f"rank {i} says it is on node {p.node}, the configuration says {nodes[i]}"
            )
