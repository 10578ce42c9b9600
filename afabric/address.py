"""Engine addresses: opaque bytes a peer needs to reach an engine (all its NICs)."""

from __future__ import annotations

from collections.abc import Callable

from . import _native


class Address:
    """An engine's address. ``bytes(a)`` to send it, ``Address.from_bytes(b)`` to take it back
    (checked: a truncated or corrupted blob raises :class:`afabric.errors.BadDescriptor`)."""

    __slots__ = ("_blob", "incarnation", "nics")

    def __init__(self, blob: bytes) -> None:
        blob = bytes(blob)
        self.incarnation, self.nics = _native.check_address(blob)
        self._blob = blob

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
        return f"Address({self._blob.hex()[:16]}…, nics={self.nics})"

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
