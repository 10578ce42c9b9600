"""Memory-region descriptors: what a target hands to initiators so they can write to it (or
read from it, as its ``access`` says)."""

from __future__ import annotations

import struct
from collections.abc import Callable

from . import _native
from .address import Address


def _access_text(flags: int) -> str:
    return ("r" if flags & _native.MR_REMOTE_READ else "") + ("w" if flags & _native.MR_REMOTE else "")


class MrDesc:
    """A remote memory region: owner address, range and per-NIC keys in one compact blob.

    ``bytes(d)`` / ``MrDesc.from_bytes(b)`` and pickle round-trip it. Construction decodes
    the blob with the shim's decoder, so a truncated, corrupted or foreign blob raises
    :class:`afabric.errors.BadDescriptor` here, long before anything is posted.
    """

    __slots__ = ("_blob", "_rid", "access", "base", "device", "incarnation", "length", "nics", "provider")

    @property
    def owner(self) -> Address:
        """The address of the engine that registered the region (the descriptor carries it)."""
        (addr_len,) = struct.unpack_from("<I", self._blob, 4)
        return Address(self._blob[8 : 8 + addr_len])

    def __init__(self, blob: bytes) -> None:
        blob = bytes(blob)
        info = _native.decode_descriptor(blob)
        self._blob = blob
        self.length: int = int(info.length)
        self.base: int = int(info.base)
        self.device: int = int(info.device)
        self.incarnation: int = int(info.incarnation)
        self.provider: str = info.provider.decode(errors="replace")
        self.nics: int = int(info.nics)
        # what the owner lets peers do: "r", "w" or "rw" ("" for a descriptor made before
        # reads existed, which does not say: only the owner's provider checks then)
        self.access: str = _access_text(int(info.access))
        # (engine's token, remote id): the id the last engine that used it imported it as
        # (Engine._remote), so a write need not look the blob up again; engine-private
        self._rid: tuple[object, int] | None = None

    @classmethod
    def from_bytes(cls, blob: bytes | bytearray | memoryview) -> MrDesc:
        """The descriptor encoded in ``blob`` (what ``bytes(desc)`` gave).

        Args:
            blob: the descriptor's bytes.

        Returns:
            The descriptor, decoded and checked.

        Raises:
            BadDescriptor: the blob is truncated, corrupted or not a descriptor.
        """
        return cls(bytes(blob))

    def __bytes__(self) -> bytes:
        return self._blob

    def __len__(self) -> int:
        return len(self._blob)

    @property
    def keys(self) -> tuple[int, ...]:
        """The remote key of each NIC (what a target's refusal names: "remote key ...")."""
        # the blob ends with { u64 remote_base, u64 key } per NIC, then the u32 checksum
        at = len(self._blob) - 4 - 16 * self.nics
        return tuple(struct.unpack_from("<Q", self._blob, at + 16 * i + 8)[0] for i in range(self.nics))

    def __repr__(self) -> str:
        return (
            f"MrDesc(length={self.length}, provider={self.provider}, nics={self.nics}, "
            f"access={self.access!r}, key={self.keys[0]:016x}, "
            f"owner={self.incarnation:016x})"
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MrDesc) and other._blob == self._blob

    def __hash__(self) -> int:
        return hash(self._blob)

    def __reduce__(self) -> tuple[Callable[[bytes], MrDesc], tuple[bytes]]:
        return (MrDesc.from_bytes, (self._blob,))
