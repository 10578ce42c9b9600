"""The KV-cache control messages, page allocator and write plans, without a transport:
property tests of the strict parser (anything a peer can send either parses to what was
encoded or raises ProtocolError, never anything else) and of the page bookkeeping."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import random
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import afabric
from afabric.errors import InvalidArgument
from afabric.kvcache import CacheFull, KvCacheLayout, PageAllocator, ProtocolError, plan, wire

LAYOUT = KvCacheLayout(
    num_layers=4,
    num_kv_heads=2,
    head_dim=64,
    dtype="float16",
    tokens_per_page=16,
    num_pages=256,
    tail_bytes=128,
)
PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@functools.lru_cache(maxsize=1)
def _blobs() -> tuple[bytes, bytes, bytes]:
    """A real address and real cache/tail descriptors (of a closed engine: parsing needs
    no live engine)."""

    async def make() -> tuple[bytes, bytes, bytes]:
        async with afabric.Engine("tcp") as eng:
            cache = eng.register(np.zeros(LAYOUT.total_bytes, dtype=np.uint8))
            tail = eng.register(np.zeros(LAYOUT.tail_region_bytes, dtype=np.uint8))
            assert cache.descriptor is not None and tail.descriptor is not None
            return bytes(eng.address), bytes(cache.descriptor), bytes(tail.descriptor)

    return asyncio.run(make())


@pytest.fixture(autouse=True)
def _loop_exceptions() -> None:
    """These tests are synchronous (the blobs come from a short-lived loop of their own)."""


def _request(
    segs: np.ndarray, tokens: int, tail: bool = True, payload: bytes = b"", rid: int = 7
) -> wire.Request:
    _, cache, tail_desc = _blobs()
    return wire.Request(
        rid, LAYOUT.fingerprint(), LAYOUT.num_pages, tokens, 99, tail, 128 if tail else 0, cache,
        tail_desc if tail else b"", segs, payload,
    )  # fmt: skip


def _roundtrip(req: wire.Request, max_message: int = 65536) -> wire.Request:
    sender = _blobs()[0]
    frags = [wire.parse(m) for m in wire.encode_request(sender, req, max_message)]
    assert all(isinstance(f, wire.Fragment) and f.sender == sender for f in frags)
    random.Random(1).shuffle(frags)  # the transport is unordered
    chunks = {f.index: f.chunk for f in frags if isinstance(f, wire.Fragment)}
    f0 = frags[0]
    assert isinstance(f0, wire.Fragment) and len(chunks) == f0.count
    blob = b"".join(chunks[i] for i in range(f0.count))
    assert zlib.crc32(blob) == f0.blob_crc
    return wire.parse_request(f0.request_id, blob)


# ---- round trips ----


@PROPS
@given(
    rid=st.integers(0, 2**64 - 1),
    tokens=st.integers(1, 2**32 - 1),
    nseg=st.integers(0, 40),
    payload=st.binary(max_size=3000),
    tail=st.booleans(),
    max_message=st.sampled_from([512, 4096, 65536]),
)
def test_request_round_trips_through_fragments(
    rid: int, tokens: int, nseg: int, payload: bytes, tail: bool, max_message: int
) -> None:
    segs = np.random.default_rng(nseg).integers(0, 2**32 - 1, size=(nseg, 3), dtype=np.int64)
    req = _request(segs, tokens, tail, payload, rid)
    for m in wire.encode_request(_blobs()[0], req, max_message):
        assert len(m) <= max_message
    got = _roundtrip(req, max_message)
    assert got.request_id == rid and got.num_tokens == tokens and got.payload == payload
    assert got.write_tail == tail and got.cache_desc == req.cache_desc and got.tail_desc == req.tail_desc
    assert np.array_equal(got.segments, segs)


@PROPS
@given(
    rid=st.integers(0, 2**64 - 1),
    status=st.sampled_from(sorted(wire.STATUS_NAMES)),
    arrivals=st.integers(0, 2**64 - 1),
    reason=st.text(max_size=300),
    role=st.sampled_from([wire.DECODER, wire.PREFILLER]),
)
def test_small_messages_round_trip(rid: int, status: int, arrivals: int, reason: str, role: int) -> None:
    me = _blobs()[0]
    assert wire.parse(wire.encode_cancel(me, rid)) == wire.Cancel(me, rid)
    c = wire.parse(wire.encode_confirm(me, rid, status, arrivals, reason))
    assert isinstance(c, wire.Confirm) and (c.request_id, c.status, c.arrivals) == (rid, status, arrivals)
    assert c.reason == reason.encode("utf-8", errors="replace")[: wire.MAX_REASON].decode(
        "utf-8", errors="replace"
    )
    assert wire.parse(wire.encode_heartbeat(me, role, rid)) == wire.Heartbeat(me, role, rid)
    assert wire.parse(wire.encode_release(me, rid)) == wire.Release(me, rid)


@PROPS
@given(
    rid=st.integers(0, 2**64 - 1),
    pages=st.integers(1, 2**32 - 1),
    first=st.integers(0, 2**32 - 1),
    tail=st.booleans(),
    offset=st.integers(0, 2**64 - 1),
)
def test_ready_round_trips(rid: int, pages: int, first: int, tail: bool, offset: int) -> None:
    me, cache, tail_desc = _blobs()
    first %= pages
    offset = offset if tail else 0
    m = wire.parse(wire.encode_ready(me, rid, pages, first, cache, tail_desc if tail else b"", offset))
    assert m == wire.Ready(me, rid, pages, first, tail, offset, cache, tail_desc if tail else b"")


def test_pull_flag_round_trips_and_old_versions_are_refused() -> None:
    segs = np.array([[0, 10, 4]], dtype=np.int64)
    req = _request(segs, 60)
    assert not _roundtrip(req).pull
    assert _roundtrip(dataclasses.replace(req, pull=True)).pull
    for msg in _valid_messages():
        old = _reframe(msg[5], msg[wire.HEADER_SIZE :], version=1)
        with pytest.raises(ProtocolError, match="version 1"):
            wire.parse(old)


def test_malformed_ready_is_refused() -> None:
    me, cache, tail = _blobs()
    good = wire.parse(wire.encode_ready(me, 1, 8, 0, cache, tail, 0))
    assert isinstance(good, wire.Ready)
    fixed = struct.Struct("<QIIIQ")

    def ready(
        pages: int, first: int, flags: int, offset: int, cdesc: bytes, tdesc: bytes, cut: int = 0,
        extra: bytes = b"",
    ) -> bytes:  # fmt: skip
        body = fixed.pack(1, pages, first, flags, offset)
        body += struct.pack("<I", len(cdesc)) + cdesc + struct.pack("<I", len(tdesc)) + tdesc
        body = body[: len(body) - cut] + extra
        return _reframe(wire.READY, struct.pack("<H", len(me)) + me + body)

    assert wire.parse(ready(8, 0, wire.FLAG_TAIL, 0, cache, tail)) == good
    for bad, why in [
        (ready(0, 0, 0, 0, cache, b""), "staging pages"),
        (ready(8, 8, 0, 0, cache, b""), "staging pages"),
        (ready(8, 0, 4, 0, cache, b""), "unknown flags"),
        (ready(8, 0, 0, 0, b"", b""), "cache descriptor of 0"),
        (ready(8, 0, 0, 0, cache, tail), "tail descriptor"),  # a tail without its flag
        (ready(8, 0, wire.FLAG_TAIL, 0, cache, b""), "tail descriptor"),  # the flag without one
        (ready(8, 0, 0, 64, cache, b""), "tail offset without"),
        (ready(8, 0, 0, 0, cache, b"", cut=1), "truncated"),
        (ready(8, 0, 0, 0, cache, b"", extra=b"x"), "unexpected bytes"),
    ]:
        with pytest.raises(ProtocolError, match=why):
            wire.parse(bad)


def test_check_ready_accepts_only_readable_regions_that_fit() -> None:
    me = _blobs()[0]
    cache, tail, wonly = _pull_descs()
    n = 5  # the request's pages; the staging region is LAYOUT's 256 pages (a tail of 128 B)

    def check(m: bytes, want_tail: bool = True) -> None:
        r = wire.parse(m)
        assert isinstance(r, wire.Ready)
        wire.check_ready(r, LAYOUT, n, want_tail)

    check(wire.encode_ready(me, 1, 256, 251, cache, tail, LAYOUT.tail_region_bytes - 128))
    check(wire.encode_ready(me, 1, 256, 0, cache), want_tail=False)
    for m, want_tail, why in [
        (wire.encode_ready(me, 1, 256, 252, cache, tail), True, "past its"),
        (wire.encode_ready(me, 1, 257, 0, cache, tail), True, "do not fit"),
        (wire.encode_ready(me, 1, 256, 0, cache, tail, LAYOUT.tail_region_bytes - 127), True, "overruns"),
        (wire.encode_ready(me, 1, 256, 0, cache), True, "no tail, one asked"),
        (wire.encode_ready(me, 1, 256, 0, cache, tail), False, "a tail, none asked"),
        (wire.encode_ready(me, 1, 256, 0, b"\0" * 40, tail), True, "bad descriptor"),
    ]:
        with pytest.raises(ProtocolError, match=why):
            check(m, want_tail)
    with pytest.raises(ProtocolError, match="does not let peers read"):
        check(wire.encode_ready(me, 1, 256, 0, wonly, tail))


@functools.lru_cache(maxsize=1)
def _pull_descs() -> tuple[bytes, bytes, bytes]:
    """A staging cache and tail registered as a prefiller serving pulls does (remote="r"),
    and a write-only cache region."""

    async def make() -> tuple[bytes, bytes, bytes]:
        async with afabric.Engine("tcp") as eng:
            out = [
                eng.register(np.zeros(n, dtype=np.uint8), remote=access).descriptor
                for n, access in [
                    (LAYOUT.total_bytes, "r"), (LAYOUT.tail_region_bytes, "r"), (LAYOUT.total_bytes, "w"),
                ]
            ]  # fmt: skip
            return bytes(out[0] or b""), bytes(out[1] or b""), bytes(out[2] or b"")

    return asyncio.run(make())


# ---- the parser never raises anything but ProtocolError ----


def _valid_messages() -> list[bytes]:
    me = _blobs()[0]
    segs = np.array([[0, 10, 4], [4, 30, 2]], dtype=np.int64)
    return [
        *wire.encode_request(me, _request(segs, 90, payload=b"x" * 700), 512),
        wire.encode_cancel(me, 3),
        wire.encode_confirm(me, 3, wire.CANCELLED, 17, "why"),
        wire.encode_heartbeat(me, wire.DECODER, 5),
        wire.encode_ready(me, 3, 64, 9, _blobs()[1], _blobs()[2], 256),
        wire.encode_ready(me, 4, 64, 9, _blobs()[1]),
        wire.encode_release(me, 3),
    ]


@PROPS
@given(data=st.binary(max_size=2000))
def test_random_bytes_are_rejected_cleanly(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.parse(data)
    with pytest.raises(ProtocolError):
        wire.parse_request(1, data)


def _reframe(kind: int, body: bytes, magic: bytes = wire.MAGIC, version: int = wire.VERSION) -> bytes:
    """A message with a *correct* checksum around an arbitrary body: gets past the CRC so
    that the body's own checks are what is tested."""
    head = struct.pack("<4sBBHII", magic, version, kind, 0, len(body), 0)
    crc = zlib.crc32(body, zlib.crc32(head[:12]))
    return struct.pack("<4sBBHII", magic, version, kind, 0, len(body), crc) + body


@PROPS
@given(
    which=st.integers(0, 100),
    op=st.sampled_from(["truncate", "flip", "extend", "reframe-truncate", "reframe-flip", "reframe-extend"]),
    where=st.integers(0, 10**6),
    extra=st.binary(min_size=1, max_size=64),
)
def test_mutated_messages_parse_to_themselves_or_fail_cleanly(
    which: int, op: str, where: int, extra: bytes
) -> None:
    msgs = _valid_messages()
    msg = msgs[which % len(msgs)]
    head, body = msg[: wire.HEADER_SIZE], msg[wire.HEADER_SIZE :]
    if op.startswith("reframe"):
        kind = head[5]
        if op.endswith("truncate"):
            body = body[: where % max(1, len(body))]
        elif op.endswith("flip"):
            i = where % len(body)
            body = body[:i] + bytes([body[i] ^ (1 << (where % 8))]) + body[i + 1 :]
        else:
            body = body + extra
        bad = _reframe(kind, body)
    elif op == "truncate":
        bad = msg[: where % len(msg)]
    elif op == "flip":
        i = where % len(msg)
        bad = msg[:i] + bytes([msg[i] ^ (1 << (where % 8))]) + msg[i + 1 :]
    else:
        bad = msg + extra
    try:
        m = wire.parse(bad)
    except ProtocolError:
        return
    # accepted: then it is a well-formed message of its kind (a flipped request id, say)
    assert isinstance(m, (wire.Fragment, wire.Cancel, wire.Confirm, wire.Heartbeat, wire.Ready, wire.Release))


@PROPS
@given(
    segs=st.lists(
        st.tuples(st.integers(-3, 300), st.integers(-3, 300), st.integers(-2, 40)), min_size=0, max_size=12
    ),
    tokens=st.integers(0, 5000),
    tail=st.booleans(),
    tail_offset=st.integers(0, 2**20),
    max_write=st.sampled_from([LAYOUT.block_bytes, 8 * LAYOUT.block_bytes, 2**40]),
)
def test_check_request_accepts_only_writable_requests(
    segs: list[tuple[int, int, int]], tokens: int, tail: bool, tail_offset: int, max_write: int
) -> None:
    arr = np.array(segs, dtype=np.int64).reshape(-1, 3)
    if (arr < 0).any():
        # negative fields cannot even be encoded (u32): the parser sees huge values instead
        arr = arr & 0xFFFFFFFF
    req = _request(arr, tokens, tail)
    req = wire.Request(**{**req.__dict__, "tail_offset": tail_offset})
    parsed = _roundtrip(req)
    try:
        checked = wire.check_request(parsed, LAYOUT, max_write=max_write, max_tokens=4096)
    except ProtocolError:
        return
    # accepted: every write lands inside the decoder's cache, inside the prompt, no overlaps
    assert 1 <= tokens <= 4096
    pp = LAYOUT.pages_for(tokens)
    assert checked.prompt_pages == pp
    used_dst, used_pos = set(), set()
    for pos, dst, n in parsed.segments.tolist():
        assert n >= 1 and n * LAYOUT.block_bytes <= max_write
        assert pos + n <= pp and dst + n <= LAYOUT.num_pages
        assert not used_dst & set(range(dst, dst + n)) and not used_pos & set(range(pos, pos + n))
        used_dst |= set(range(dst, dst + n))
        used_pos |= set(range(pos, pos + n))
    if tail:
        assert checked.tail is not None and tail_offset + LAYOUT.tail_bytes <= checked.tail.length


def test_requests_that_do_not_fit_are_refused() -> None:
    segs = np.array([[0, 0, 2]], dtype=np.int64)
    ok = _request(segs, 20)
    wire.check_request(ok, LAYOUT, max_write=1 << 30, max_tokens=4096)
    other = KvCacheLayout(4, 2, 64, "bfloat16", 16, 256, tail_bytes=128)  # same sizes, other dtype
    with pytest.raises(ProtocolError, match="geometry"):
        wire.check_request(ok, other, max_write=1 << 30, max_tokens=4096)
    bad_desc = wire.Request(**{**ok.__dict__, "cache_desc": ok.cache_desc[:-3]})
    with pytest.raises(ProtocolError, match="cache descriptor"):
        wire.check_request(bad_desc, LAYOUT, max_write=1 << 30, max_tokens=4096)
    too_many_pages = wire.Request(**{**ok.__dict__, "num_pages": LAYOUT.num_pages + 1})
    with pytest.raises(ProtocolError, match="do not fit"):
        wire.check_request(too_many_pages, LAYOUT, max_write=1 << 30, max_tokens=4096)
    with pytest.raises(ProtocolError, match="immediate 0"):
        wire.check_request(
            wire.Request(**{**ok.__dict__, "imm": 0}), LAYOUT, max_write=1 << 30, max_tokens=4096
        )
    with pytest.raises(ProtocolError, match="messages of"):
        wire.encode_request(_blobs()[0], ok, 100)


# ---- pages ----


@PROPS
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 40), st.booleans()), max_size=60))
def test_allocator_never_hands_out_a_page_twice(ops: list[tuple[bool, int, bool]]) -> None:
    a = PageAllocator(100)
    held: list[np.ndarray] = []
    rng = random.Random(len(ops))
    for is_alloc, n, contiguous in ops:
        if is_alloc or not held:
            try:
                pages = a.alloc(n, contiguous=contiguous)
            except CacheFull:
                assert n > a.free_pages or contiguous
                continue
            assert len(pages) == n and len(set(pages.tolist())) == n
            if contiguous:
                assert (np.diff(pages) == 1).all()
            held.append(pages)
        else:
            a.free(held.pop(rng.randrange(len(held))))
        in_use = np.concatenate(held) if held else np.zeros(0, dtype=np.int64)
        assert len(set(in_use.tolist())) == len(in_use), "a page is held twice"
        assert a.free_pages == 100 - len(in_use)
    for pages in held:
        a.free(pages)
    assert a.free_pages == 100 and (a.alloc(100, contiguous=True) == np.arange(100)).all()


def test_allocator_refuses_double_free_and_strays() -> None:
    a = PageAllocator(10)
    p = a.alloc(4)
    a.free(p)
    with pytest.raises(InvalidArgument, match="already free"):
        a.free(p[:1])
    with pytest.raises(InvalidArgument):
        a.free([10])
    assert a.free_pages == 10


@PROPS
@given(
    pages=st.lists(st.integers(0, 200), unique=True, min_size=1, max_size=80),
    max_run=st.integers(1, 9),
    ranks=st.integers(1, 5),
    seed=st.integers(0, 1000),
)
def test_segments_cover_the_pages_and_ranks_are_balanced(
    pages: list[int], max_run: int, ranks: int, seed: int
) -> None:
    segs = plan.segments(pages, max_run)
    rebuilt = [dst + k for _, dst, n in segs.tolist() for k in range(n)]
    assert rebuilt == pages and all(1 <= n <= max_run for n in segs[:, 2].tolist())
    assert [pos for pos, _, _ in segs.tolist()] == sorted(pos for pos, _, _ in segs.tolist())
    shares = plan.split_among(segs, ranks, random.Random(seed))
    assert len(shares) == ranks
    covered = sorted((pos + k, dst + k) for s in shares for pos, dst, n in s.tolist() for k in range(n))
    assert covered == [(i, p) for i, p in enumerate(pages)]
    loads = [int(s[:, 2].sum()) if s.size else 0 for s in shares]
    piece = -(-len(pages) // ranks)
    assert max(loads) - min(loads) <= piece


def test_layer_writes_address_heads_before_pages() -> None:
    src = LAYOUT.with_pages(32)
    segs = np.array([[0, 100, 3], [3, 7, 1]], dtype=np.int64)
    writes = plan.layer_writes(src, LAYOUT, 2, segs, first_page=5)
    assert sorted(w.page_len for w in writes) == [LAYOUT.block_bytes, 3 * LAYOUT.block_bytes]
    assert sum(len(w.src_idx) for w in writes) == LAYOUT.blocks_per_layer * 2
    for w in writes:
        for s, d in zip(w.src_idx.tolist(), w.dst_idx.tolist(), strict=True):
            # decode both block indices back to (layer, part, head, page)
            sl, sp = divmod(s, src.num_pages)
            dl, dp = divmod(d, LAYOUT.num_pages)
            assert sl == dl and sl // LAYOUT.blocks_per_layer == 2  # same layer, part and head
            assert (sp, dp) in ((5, 100), (8, 7))
    assert plan.arrivals(LAYOUT, segs) == LAYOUT.num_layers * LAYOUT.blocks_per_layer * 2
