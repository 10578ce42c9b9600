"""Engine addresses: opaque bytes a peer needs to reach an engine (all its NICs)."""

from __future__ import annotations

import struct
from collections.abc import Callable

from . import _native


def _skip_nics(blob: bytes, at: int, nics: int) -> int:
    for _ in range(nics):
        at += 2 + struct.unpack_from("<H", blob, at)[0]
    return at


def _owner(blob: bytes) -> tuple[tuple[str, ...], int | None, int | None]:
    """(transports, pid, host id) of a checked address blob (shim/codec.c). "AFA1": u8 nics
    u8 name_len u16 max_msg u64 incarnation name, per NIC u16 len + bytes; "AFA2": u8
    transports u8 0 u16 max_msg u64 incarnation, per transport u8 name_len name u8 nics and
    its NICs. Then an optional "L" u64 host u32 pid u64 start, then u32 crc; pid and host
    None if absent."""
    names: list[str] = []
    if blob[:4] == b"AFA2":
        at = 16
        for _ in range(blob[4]):
            name_len = blob[at]
            names.append(blob[at + 1 : at + 1 + name_len].decode(errors="replace"))
            at += 1 + name_len
            at = _skip_nics(blob, at + 1, blob[at])
    else:
        nics, name_len = blob[4], blob[5]
        names.append(blob[16 : 16 + name_len].decode(errors="replace"))
        at = _skip_nics(blob, 16 + name_len, nics)
    if blob[at : at + 1] == b"L" and at + 21 <= len(blob) - 4:
        host, pid = struct.unpack_from("<QI", blob, at + 1)
        return tuple(names), int(pid), int(host)
    return tuple(names), None, None


class Address:
    """An engine's address. ``bytes(a)`` to send it, ``Address.from_bytes(b)`` to take it back
    (checked: a truncated or corrupted blob raises :class:`afabric.errors.BadDescriptor`)."""

    __slots__ = ("_blob", "host", "incarnation", "nics", "pid", "provider", "transports")

    def __init__(self, blob: bytes) -> None:
        blob = bytes(blob)
        self.incarnation, self.nics = _native.check_address(blob)
        self._blob = blob
        self.transports: tuple[str, ...]
        """The transports of the engine that made it, in the order it prefers them."""
        self.provider: str
        """The provider of the engine that made it ("tcp"; "cma+tcp" for a routed engine)."""
        self.pid: int | None
        """Its process id (None: the address does not say)."""
        self.host: int | None
        """Its host (boot id and pid namespace, hashed; None: not said): equal for engines
        that can watch each other's processes."""
        self.transports, self.pid, self.host = _owner(blob)
        self.provider = "+".join(self.transports)

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> Address:
        """The address encoded in ``blob`` (what ``bytes(address)`` gave).

        Args:
            blob: the address's bytes.

        Returns:
            The address.

        Raises:
            BadDescriptor: the blob is truncated, corrupted or not an address.
        """
        return cls(bytes(blob))

    def __bytes__(self) -> bytes:
        return self._blob

    def __str__(self) -> str:
        return self._blob.hex()

    def __repr__(self) -> str:
        """What tells engines apart in a log: provider, process, host and incarnation (the
        creation time in its high half, random bits in its low half)."""
        where = "" if self.pid is None else f", pid {self.pid} on host {(self.host or 0) & 0xFFFFFFFF:08x}"
        return f"Address({self.provider}{where}, incarnation {self.incarnation:016x}, nics={self.nics})"

    def short(self) -> str:
        """A short tag for log lines: the low half of the incarnation in hex.

        Returns:
            Eight hex digits (the high half is the creation time, shared by engines made in the
            same second).
        """
        return f"{self.incarnation & 0xFFFFFFFF:08x}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Address) and other._blob == self._blob

    def __hash__(self) -> int:
        return hash(self._blob)

    def __reduce__(self) -> tuple[Callable[[bytes], Address], tuple[bytes]]:
        return (Address.from_bytes, (self._blob,))
