"""The KV-cache control messages and their strict parser.

Six kinds travel with ``Engine.send``/``recv`` between decoders and prefillers:

- ``REQUEST`` (decoder -> prefiller), in fragments that fit the engine's message size: where
  to write (cache and tail descriptors, page segments), the immediate to count, the prompt's
  length and an application payload (e.g. token ids);
- ``CANCEL`` (decoder -> prefiller): stop writing this request;
- ``CONFIRM`` (prefiller -> decoder): no write of this request can still be posted, and how
  many immediates its writes delivered (so the decoder can wait for exactly those to land);
  also the answer to a request that was refused;
- ``HEARTBEAT`` (both ways): the sender is alive;
- ``READY`` (prefiller -> decoder, pull mode: a request with ``FLAG_PULL``): the request's
  pages are computed and held in the prefiller's staging cache: its descriptor (registered
  ``remote="r"``), the staging page count, where the request's run starts, and the tail's
  descriptor and offset; the decoder reads them;
- ``RELEASE`` (decoder -> prefiller, pull mode): the decoder has read (or gave up on) the
  request's pages; the prefiller may reuse them.

Version 2 added ``READY``, ``RELEASE`` and ``FLAG_PULL``; a message of another version is
refused.

Every message is ``header | body``: magic ``AFKV``, version, kind, a reserved zero, the body
length and a CRC-32 of everything else; the body starts with the sender's address, which
the receiver checks against the sender the transport reports (:mod:`.peers`). :func:`parse`
accepts exactly what :func:`encode` makes and raises :class:`ProtocolError` for anything
else: it never raises another exception, never reads past the message, and checks every
count against the bytes actually present before allocating anything.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ..address import Address
from ..descriptor import MrDesc
from ..errors import AfabricError
from .errors import ProtocolError
from .layout import KvCacheLayout

MAGIC = b"AFKV"
VERSION = 2
REQUEST, CANCEL, CONFIRM, HEARTBEAT, READY, RELEASE = 1, 2, 3, 4, 5, 6
KINDS = {
    REQUEST: "request", CANCEL: "cancel", CONFIRM: "confirm", HEARTBEAT: "heartbeat", READY: "ready",
    RELEASE: "release",
}  # fmt: skip

# CONFIRM statuses
DONE, CANCELLED, FAILED, REJECTED, UNKNOWN = 0, 1, 2, 3, 4
STATUS_NAMES = {
    DONE: "done",
    CANCELLED: "cancelled",
    FAILED: "failed",
    REJECTED: "rejected",
    UNKNOWN: "unknown",
}
ARRIVALS_UNKNOWN = (1 << 64) - 1  # some write failed: how many of its pages landed is not known

DECODER, PREFILLER = 0, 1

FLAG_TAIL = 1  # this prefiller writes the tail (pull: holds it for the decoder to read)
FLAG_PULL = 2  # pull mode: compute, hold the pages, send READY; the decoder reads them

MAX_BLOB = 64 << 20  # a request (segments + payload) of at most 64 MiB
MAX_REASON = 1024
MAX_ADDRESS = 4096
MAX_DESC = 1 << 16

_HEADER = struct.Struct("<4sBBHII")  # magic, version, kind, reserved, body length, crc32
_FRAG = struct.Struct("<QIIII")  # request id, blob length, fragment size, fragment index, blob crc
_CONFIRM = struct.Struct("<QBQH")  # request id, status, arrivals, reason length
_HEARTBEAT = struct.Struct("<BQ")  # role, sequence
_READY = struct.Struct("<QIIIQ")  # request id, staging pages, first page, flags, tail offset
_REQ_FIXED = struct.Struct("<16sIIIIQ")  # fingerprint, cache pages, tokens, imm, flags, tail offset
SEGMENT_DTYPE = np.dtype("<u4")

HEADER_SIZE = _HEADER.size


@dataclass(frozen=True)
class Request:
    """A decoder's request to one prefiller. ``segments`` is an (n, 3) int64 array of
    ``(pos, dst, count)``: prompt pages ``pos .. pos+count-1`` go to the decoder's pages
    ``dst .. dst+count-1``."""

    request_id: int
    fingerprint: bytes
    num_pages: int  # pages of the decoder's cache (its layout's num_pages)
    num_tokens: int
    imm: int
    write_tail: bool
    tail_offset: int
    cache_desc: bytes
    tail_desc: bytes
    segments: npt.NDArray[np.int64]
    payload: bytes = b""
    pull: bool = False

    def blob(self) -> bytes:
        segs = np.ascontiguousarray(self.segments, dtype=SEGMENT_DTYPE).reshape(-1, 3)
        return b"".join((
            _REQ_FIXED.pack(
                self.fingerprint, self.num_pages, self.num_tokens, self.imm,
                (FLAG_TAIL if self.write_tail else 0) | (FLAG_PULL if self.pull else 0), self.tail_offset,
            ),
            _lp32(self.cache_desc), _lp32(self.tail_desc),
            struct.pack("<I", segs.shape[0]), segs.tobytes(),
            _lp32(self.payload),
        ))  # fmt: skip

    @property
    def pages(self) -> int:
        """Pages this prefiller writes (per head and layer)."""
        return int(self.segments[:, 2].sum()) if self.segments.size else 0


@dataclass(frozen=True)
class Fragment:
    sender: bytes
    request_id: int
    blob_len: int
    frag_size: int
    index: int
    blob_crc: int
    chunk: bytes

    @property
    def count(self) -> int:
        return -(-self.blob_len // self.frag_size) if self.blob_len else 1


@dataclass(frozen=True)
class Cancel:
    sender: bytes
    request_id: int


@dataclass(frozen=True)
class Confirm:
    sender: bytes
    request_id: int
    status: int
    arrivals: int
    reason: str = ""


@dataclass(frozen=True)
class Heartbeat:
    sender: bytes
    role: int
    seq: int


@dataclass(frozen=True)
class Ready:
    """Pull mode: the request's prompt pages are pages ``first_page ..`` of the prefiller's
    staging cache (``staging_pages`` pages in the layout's order, region ``cache_desc``);
    with ``has_tail``, its tail is at ``tail_offset`` of region ``tail_desc``."""

    sender: bytes
    request_id: int
    staging_pages: int
    first_page: int
    has_tail: bool
    tail_offset: int
    cache_desc: bytes
    tail_desc: bytes


@dataclass(frozen=True)
class Release:
    sender: bytes
    request_id: int


Message = Fragment | Cancel | Confirm | Heartbeat | Ready | Release


def _lp32(b: bytes) -> bytes:
    return struct.pack("<I", len(b)) + b


def _frame(kind: int, sender: bytes, body: bytes) -> bytes:
    payload = struct.pack("<H", len(sender)) + sender + body
    head = _HEADER.pack(MAGIC, VERSION, kind, 0, len(payload), 0)
    crc = zlib.crc32(payload, zlib.crc32(head[:12]))
    return _HEADER.pack(MAGIC, VERSION, kind, 0, len(payload), crc) + payload


def fragment_room(max_message: int, sender: bytes) -> int:
    """Bytes of request blob one fragment can carry in a message of ``max_message``."""
    return max_message - HEADER_SIZE - 2 - len(sender) - _FRAG.size


def encode_request(sender: bytes, req: Request, max_message: int) -> list[bytes]:
    """A request as one or more fragments, each at most ``max_message`` bytes."""
    blob = req.blob()
    if len(blob) > MAX_BLOB:
        raise ProtocolError(f"request of {len(blob)} bytes exceeds the {MAX_BLOB}-byte limit")
    room = fragment_room(max_message, sender)
    if room < 64:
        raise ProtocolError(f"messages of {max_message} bytes are too small for a request")
    crc = zlib.crc32(blob)
    count = max(1, -(-len(blob) // room))
    head = [_FRAG.pack(req.request_id, len(blob), room, i, crc) for i in range(count)]
    return [_frame(REQUEST, sender, head[i] + blob[i * room : (i + 1) * room]) for i in range(count)]


def encode_cancel(sender: bytes, request_id: int) -> bytes:
    return _frame(CANCEL, sender, struct.pack("<Q", request_id))


def encode_confirm(sender: bytes, request_id: int, status: int, arrivals: int, reason: str = "") -> bytes:
    text = reason.encode("utf-8", errors="replace")[:MAX_REASON]
    return _frame(CONFIRM, sender, _CONFIRM.pack(request_id, status, arrivals, len(text)) + text)


def encode_heartbeat(sender: bytes, role: int, seq: int) -> bytes:
    return _frame(HEARTBEAT, sender, _HEARTBEAT.pack(role, seq))


def encode_ready(
    sender: bytes, request_id: int, staging_pages: int, first_page: int, cache_desc: bytes,
    tail_desc: bytes = b"", tail_offset: int = 0,
) -> bytes:  # fmt: skip
    flags = FLAG_TAIL if tail_desc else 0
    fixed = _READY.pack(request_id, staging_pages, first_page, flags, tail_offset)
    return _frame(READY, sender, fixed + _lp32(cache_desc) + _lp32(tail_desc))


def encode_release(sender: bytes, request_id: int) -> bytes:
    return _frame(RELEASE, sender, struct.pack("<Q", request_id))


# ---- parsing ----


class _Reader:
    """Bounds-checked reads from one message; every shortfall is a ProtocolError."""

    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def take(self, n: int, name: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            left = len(self.data) - self.pos
            raise ProtocolError(f"{self.what}: truncated at {name} ({left} bytes left, {n} needed)")
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, st: struct.Struct, name: str) -> tuple[int | bytes, ...]:
        return st.unpack(self.take(st.size, name))

    def u32(self, name: str) -> int:
        return int(struct.unpack("<I", self.take(4, name))[0])

    def rest(self) -> bytes:
        out = self.data[self.pos :]
        self.pos = len(self.data)
        return out

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.what}: {len(self.data) - self.pos} unexpected bytes at the end")


def _open(msg: bytes | memoryview) -> tuple[int, _Reader, bytes]:
    """Header checks; returns the kind, a reader over the body past the sender, the sender."""
    if not isinstance(msg, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(msg).__name__}")
    data = bytes(msg)
    if len(data) < HEADER_SIZE:
        raise ProtocolError(f"message of {len(data)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, kind, reserved, body_len, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a KV-cache message (magic {magic!r})")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} (this side speaks {VERSION})")
    if kind not in KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    if reserved:
        raise ProtocolError("reserved header field is not zero")
    body = data[HEADER_SIZE:]
    if body_len != len(body):
        raise ProtocolError(f"header says {body_len} body bytes, message has {len(body)}")
    if zlib.crc32(body, zlib.crc32(data[:12])) != crc:
        raise ProtocolError("checksum mismatch (corrupted message)")
    r = _Reader(body, KINDS[kind])
    (alen,) = struct.unpack("<H", r.take(2, "sender length"))
    if not 1 <= alen <= MAX_ADDRESS:
        raise ProtocolError(f"{KINDS[kind]}: sender address of {alen} bytes")
    sender = r.take(alen, "sender address")
    try:
        Address.from_bytes(sender)
    except AfabricError as e:
        raise ProtocolError(f"{KINDS[kind]}: bad sender address: {e}") from None
    return kind, r, sender


def parse(msg: bytes | memoryview) -> Message:
    """Decode one received message, or raise :class:`ProtocolError` saying what is wrong."""
    kind, r, sender = _open(msg)
    if kind == REQUEST:
        return _parse_fragment(r, sender)
    if kind in (CANCEL, RELEASE):
        (rid,) = struct.unpack("<Q", r.take(8, "request id"))
        r.end()
        return Cancel(sender, int(rid)) if kind == CANCEL else Release(sender, int(rid))
    if kind == READY:
        return _parse_ready(r, sender)
    if kind == CONFIRM:
        rid, status, arrivals, rlen = r.unpack(_CONFIRM, "confirm fields")
        assert isinstance(rid, int) and isinstance(status, int) and isinstance(arrivals, int)
        assert isinstance(rlen, int)
        if status not in STATUS_NAMES:
            raise ProtocolError(f"confirm: unknown status {status}")
        if rlen > MAX_REASON:
            raise ProtocolError(f"confirm: reason of {rlen} bytes")
        reason = r.take(rlen, "reason").decode("utf-8", errors="replace")
        r.end()
        return Confirm(sender, rid, status, arrivals, reason)
    role, seq = r.unpack(_HEARTBEAT, "heartbeat fields")
    assert isinstance(role, int) and isinstance(seq, int)
    if role not in (DECODER, PREFILLER):
        raise ProtocolError(f"heartbeat: unknown role {role}")
    r.end()
    return Heartbeat(sender, role, seq)


def _parse_ready(r: _Reader, sender: bytes) -> Ready:
    rid, pages, first, flags, tail_offset = r.unpack(_READY, "ready fields")
    assert isinstance(rid, int) and isinstance(pages, int) and isinstance(first, int)
    assert isinstance(flags, int) and isinstance(tail_offset, int)
    if flags & ~FLAG_TAIL:
        raise ProtocolError(f"ready: unknown flags {flags:#x}")
    if pages < 1 or first >= pages:
        raise ProtocolError(f"ready: first page {first} of {pages} staging pages")
    clen = r.u32("cache descriptor length")
    if not 1 <= clen <= MAX_DESC:
        raise ProtocolError(f"ready: cache descriptor of {clen} bytes")
    cache_desc = r.take(clen, "cache descriptor")
    tlen = r.u32("tail descriptor length")
    if tlen > MAX_DESC or bool(tlen) != bool(flags & FLAG_TAIL):
        raise ProtocolError(f"ready: tail descriptor of {tlen} bytes with flags {flags:#x}")
    tail_desc = r.take(tlen, "tail descriptor")
    if not tlen and tail_offset:
        raise ProtocolError("ready: a tail offset without a tail")
    r.end()
    return Ready(sender, rid, pages, first, bool(tlen), tail_offset, cache_desc, tail_desc)


def _parse_fragment(r: _Reader, sender: bytes) -> Fragment:
    rid, blob_len, frag_size, index, blob_crc = r.unpack(_FRAG, "fragment fields")
    assert isinstance(rid, int) and isinstance(blob_len, int) and isinstance(frag_size, int)
    assert isinstance(index, int) and isinstance(blob_crc, int)
    if blob_len > MAX_BLOB:
        raise ProtocolError(f"request of {blob_len} bytes exceeds the {MAX_BLOB}-byte limit")
    if frag_size < 1:
        raise ProtocolError("request fragment size 0")
    count = max(1, -(-blob_len // frag_size))
    if index >= count:
        raise ProtocolError(f"request fragment {index} of {count}")
    chunk = r.rest()
    want = min(frag_size, blob_len - index * frag_size)
    if len(chunk) != want:
        raise ProtocolError(f"request fragment {index}: {len(chunk)} bytes, expected {want}")
    return Fragment(sender, rid, blob_len, frag_size, index, blob_crc, chunk)


def parse_request(request_id: int, blob: bytes) -> Request:
    """Decode a reassembled request blob (structure only: :func:`check_request` checks it
    against the cache)."""
    r = _Reader(blob, f"request {request_id}")
    fp, pages, tokens, imm, flags, tail_offset = r.unpack(_REQ_FIXED, "fixed fields")
    assert isinstance(fp, bytes) and isinstance(tokens, int) and isinstance(imm, int)
    assert isinstance(pages, int)
    assert isinstance(flags, int) and isinstance(tail_offset, int)
    if flags & ~(FLAG_TAIL | FLAG_PULL):
        raise ProtocolError(f"request {request_id}: unknown flags {flags:#x}")
    cache_desc = r.take(r.u32("cache descriptor length"), "cache descriptor")
    tail_desc = r.take(r.u32("tail descriptor length"), "tail descriptor")
    nseg = r.u32("segment count")
    raw = r.take(nseg * 3 * SEGMENT_DTYPE.itemsize, "segments")
    segments = np.frombuffer(raw, dtype=SEGMENT_DTYPE).astype(np.int64).reshape(nseg, 3)
    payload = r.take(r.u32("payload length"), "payload")
    r.end()
    return Request(
        request_id, fp, pages, tokens, imm, bool(flags & FLAG_TAIL), tail_offset, cache_desc, tail_desc,
        segments, payload, bool(flags & FLAG_PULL),
    )  # fmt: skip


@dataclass(frozen=True)
class Checked:
    """A request that passed :func:`check_request`, with its descriptors decoded."""

    cache: MrDesc
    tail: MrDesc | None
    prompt_pages: int


def check_request(req: Request, layout: KvCacheLayout, *, max_write: int, max_tokens: int) -> Checked:
    """Everything a prefiller must know before writing anywhere: the geometry matches,
    every segment lies inside the decoder's cache and inside the prompt, no two segments
    overlap (in the prompt or in the cache), each run fits one write, the tail fits its
    region. ``layout`` gives the model's geometry; the decoder's page count comes with the
    request and is checked against its cache region's length."""
    where = f"request {req.request_id}"
    if req.fingerprint != layout.fingerprint():
        raise ProtocolError(f"{where}: cache geometry differs from this prefiller's (layout fingerprint)")
    if not 1 <= req.num_tokens <= max_tokens:
        raise ProtocolError(f"{where}: {req.num_tokens} tokens (this prefiller takes 1..{max_tokens})")
    if req.imm == 0:
        raise ProtocolError(f"{where}: immediate 0 (alloc_imm never gives it)")
    try:
        cache = MrDesc.from_bytes(req.cache_desc)
    except AfabricError as e:
        raise ProtocolError(f"{where}: bad cache descriptor: {e}") from None
    num_pages = req.num_pages
    need = num_pages * layout.num_layers * layout.blocks_per_layer * layout.block_bytes
    if num_pages < 1 or cache.length < need:
        raise ProtocolError(f"{where}: {num_pages} pages do not fit its {cache.length}-byte cache region")
    tail = _check_tail(req, layout, where)
    segs = req.segments
    if segs.ndim != 2 or segs.shape[1] != 3:
        raise ProtocolError(f"{where}: segments must be (n, 3)")
    if segs.shape[0] == 0 and not req.write_tail:
        raise ProtocolError(f"{where}: nothing to write")
    prompt_pages = layout.pages_for(req.num_tokens)
    if segs.shape[0]:
        _check_segments(segs, layout.block_bytes, prompt_pages, num_pages, max_write, where)
    return Checked(cache, tail, prompt_pages)


def _check_tail(req: Request, layout: KvCacheLayout, where: str) -> MrDesc | None:
    if not req.write_tail:
        if req.tail_desc:
            raise ProtocolError(f"{where}: a tail descriptor without the tail flag")
        return None
    if layout.tail_bytes == 0:
        raise ProtocolError(f"{where}: asks for a tail, the layout has none")
    try:
        tail = MrDesc.from_bytes(req.tail_desc)
    except AfabricError as e:
        raise ProtocolError(f"{where}: bad tail descriptor: {e}") from None
    if req.tail_offset + layout.tail_bytes > tail.length:
        raise ProtocolError(f"{where}: tail at {req.tail_offset} overruns its {tail.length}-byte region")
    return tail


def _check_segments(
    segs: npt.NDArray[np.int64], block_bytes: int, prompt_pages: int, num_pages: int, max_write: int,
    where: str,
) -> None:  # fmt: skip
    pos, dst, n = segs[:, 0], segs[:, 1], segs[:, 2]
    if int(n.min()) < 1:
        raise ProtocolError(f"{where}: a segment of 0 pages")
    if int(n.max()) * block_bytes > max_write:
        raise ProtocolError(f"{where}: a run of {int(n.max())} pages is more than one write ({max_write} B)")
    if int((pos + n).max()) > prompt_pages:
        raise ProtocolError(f"{where}: a segment reaches past the prompt's {prompt_pages} pages")
    if int((dst + n).max()) > num_pages:
        raise ProtocolError(f"{where}: a segment reaches past the cache's {num_pages} pages")
    for name, starts in (("prompt", pos), ("cache", dst)):
        order = np.argsort(starts, kind="stable")
        s, e = starts[order], (starts + n)[order]
        if s.size > 1 and bool((s[1:] < e[:-1]).any()):
            raise ProtocolError(f"{where}: segments overlap in the {name}")


def check_ready(
    m: Ready, layout: KvCacheLayout, prompt_pages: int, want_tail: bool
) -> tuple[MrDesc, MrDesc | None]:
    """What a decoder checks before reading a prefiller's pages: the descriptors decode and
    allow reads, the staging region holds ``staging_pages`` pages of ``layout``'s geometry,
    the request's run lies inside it, the tail (exactly when this prefiller holds it) fits
    its region."""
    where = f"ready {m.request_id}"
    if m.has_tail != want_tail:
        got, asked = ("a", "none") if m.has_tail else ("no", "one")
        raise ProtocolError(f"{where}: {got} tail, {asked} asked")
    try:
        cache = MrDesc.from_bytes(m.cache_desc)
        tail = MrDesc.from_bytes(m.tail_desc) if m.has_tail else None
    except AfabricError as e:
        raise ProtocolError(f"{where}: bad descriptor: {e}") from None
    for d in (cache, tail):
        if d is not None and d.access and "r" not in d.access:
            raise ProtocolError(f"{where}: a region the prefiller does not let peers read")
    need = layout.with_pages(m.staging_pages).total_bytes
    if cache.length < need:
        raise ProtocolError(
            f"{where}: {m.staging_pages} staging pages do not fit a {cache.length}-byte region"
        )
    if m.first_page + prompt_pages > m.staging_pages:
        raise ProtocolError(f"{where}: pages {m.first_page}+{prompt_pages} past its {m.staging_pages} pages")
    if tail is not None and m.tail_offset + layout.tail_bytes > tail.length:
        raise ProtocolError(f"{where}: tail at {m.tail_offset} overruns its {tail.length}-byte region")
    return cache, tail
