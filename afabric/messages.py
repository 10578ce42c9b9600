"""Two-sided messages: what :meth:`Engine.recv` returns, tags, and the frames on the wire.

Every message the facade sends starts with a small header of its own (below): its kind,
its tag and the sender's address, so a receiver can reply (``msg.sender``) on every
provider, including those that cannot name senders. Where the provider does name the
sender (libfabric ``FI_SOURCE``: shm, tcp), the engine checks the header against it
(``Message.verified``; docs/security.md).

A message larger than what one receive buffer of the peer holds travels as fragments
after a handshake: the sender asks (``RTS``: tag, size), the receiver reserves the
memory when its bounds allow (``CTS``) or refuses a message larger than it ever takes
(``REFUSE``), and the sender then sends ``FRAG`` frames, each with its offset, which the
receiver copies into the reserved buffer in any order. Memory is reserved before any
fragment is sent, so fragments never wait for room and never need to be dropped.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .address import Address

TAG_MAX = 0xFFFFFFFF
"""Application tags are 0..TAG_MAX (default 0)."""

_RESERVED_BASE = 1 << 32
TAG_KVCACHE = _RESERVED_BASE + 1
"""Reserved: afabric.kvcache's control messages."""
TAG_WEIGHTS = _RESERVED_BASE + 2
"""Reserved: afabric.weights' control messages."""
TAG_COMPAT = _RESERVED_BASE + 3
"""Reserved: the notifications of afabric.compat (NIXL's and Mooncake's APIs)."""
RESERVED_TAGS = frozenset({TAG_KVCACHE, TAG_WEIGHTS, TAG_COMPAT})


@dataclass(frozen=True, slots=True)
class Message:
    """A received message.

    ``data`` is ``bytes`` for a message that fit one receive buffer, and a ``memoryview``
    (of a buffer owned by this message, or of the caller's buffer for ``recv_into``) for a
    larger one. ``sender`` is the sending engine's address (reply to it with ``send``).
    ``verified`` is True when the provider itself named the sender and it matched the
    address in the message's header; False when the provider cannot tell (the sender is a
    peer this engine never resolved, or the provider does not name senders): then
    ``sender`` is what the sending peer claims (docs/security.md)."""

    data: bytes | memoryview
    sender: Address
    tag: int = 0
    verified: bool = False

    def __bytes__(self) -> bytes:
        return bytes(self.data)

    def __len__(self) -> int:
        return len(self.data)


def check_tag(tag: object) -> int:
    """An application tag (0..TAG_MAX) or one of afabric's reserved tags."""
    if isinstance(tag, bool) or not isinstance(tag, int):
        raise _invalid(f"tag must be an int in 0..{TAG_MAX}, got {type(tag).__name__}")
    if 0 <= tag <= TAG_MAX or tag in RESERVED_TAGS:
        return tag
    raise _invalid(f"tag {tag} outside 0..{TAG_MAX} (larger values are reserved for afabric)")


def _invalid(text: str) -> Exception:
    from .errors import InvalidArgument

    return InvalidArgument(text)


# ---- frames ----
# magic, kind, flags (0), sender address length, 2 pad bytes, then three u64 fields whose
# meaning depends on the kind, then the sender's address, then the payload.
MAGIC = b"\xafM"
K_DATA = 1  # a: tag
K_RTS = 2  # a: tag, b: message id, c: total size
K_CTS = 3  # b: message id
K_FRAG = 4  # a: offset, b: message id
K_REFUSE = 5  # b: message id, c: the largest message the receiver takes
_HDR = struct.Struct("<2sBBHxxQQQ")
HEADER = _HDR.size  # 32


def frame(
    kind: int, me: bytes, a: int = 0, b: int = 0, c: int = 0, payload: bytes | memoryview = b""
) -> bytes:
    return b"".join((_HDR.pack(MAGIC, kind, 0, len(me), a, b, c), me, payload))


def parse(buf: bytes) -> tuple[int, int, int, int, bytes, memoryview]:
    """kind, a, b, c, the sender's address bytes and the payload (ValueError if malformed)."""
    if len(buf) < HEADER:
        raise ValueError(f"{len(buf)}-byte message is shorter than the header")
    magic, kind, _flags, alen, a, b, c = _HDR.unpack_from(buf)
    if magic != MAGIC or not K_DATA <= kind <= K_REFUSE:
        raise ValueError("not an afabric message frame")
    if HEADER + alen > len(buf):
        raise ValueError("truncated sender address")
    view = memoryview(buf)
    return kind, a, b, c, buf[HEADER : HEADER + alen], view[HEADER + alen :]


def max_message_of(address: Address) -> int:
    """The largest message the engine at ``address`` receives (announced in its address:
    the shim's codec, bytes 6..7: below 0x8000 exact, else in 4 KiB units)."""
    blob = bytes(address)
    code = int.from_bytes(blob[6:8], "little")
    return (code & 0x7FFF) << 12 if code & 0x8000 else code
