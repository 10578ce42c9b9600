"""The submit path's request struct (afs_submit_req): size-prefixed, checked
before anything is posted, and reused by the loop's thread without one call's fields (its
trigger above all) leaking into the next."""

from __future__ import annotations

import asyncio
import collections
import ctypes
import time

import numpy as np
import pytest

import afabric
from afabric import _native, errors
from afabric.bench import raw


def _request(op: int, **fields: int) -> _native.Request:
    req = _native.Request()
    req.size = ctypes.sizeof(_native.Request)
    req.op = op
    req.imm = _native.NO_IMM
    for name, value in fields.items():
        setattr(req, name, value)
    return req


async def test_plain_write_after_a_triggered_one_posts_at_once(provider: str) -> None:
    """The loop thread's request is reused: a triggered write (and a triggered paged write)
    must not leave its trigger for the next plain write, which would then wait forever."""
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        dst = b.register(np.zeros(8192, dtype=np.uint8))
        src = a.register(np.full(8192, 7, dtype=np.uint8))
        w = a.uvm_watcher()
        pages = afabric.Pages([0, 1], stride=1024)
        armed = [
            asyncio.ensure_future(a.write(src, dst.descriptor, 4096, imm=50, when=w.reaches(1))),
            asyncio.ensure_future(
                a.write_paged(
                    src,
                    dst.descriptor,
                    page_len=1024,
                    src_pages=pages,
                    dst_pages=pages,
                    imm=51,
                    when=w.reaches(1),
                )
            ),
        ]
        await asyncio.sleep(0.05)
        for plain in range(3):
            await asyncio.wait_for(a.write(src, dst.descriptor, 64, 0, 4096 + 64 * plain, imm=52), 10)
        await b.expect_imm(52, 3, timeout=10)
        left = [t.exception() or "completed" for t in armed if t.done()]
        assert not left, f"a triggered write left before its trigger: {left}"
        w.add(1)
        await asyncio.wait_for(asyncio.gather(*armed), 10)
        await b.expect_imm(50, 1, timeout=10)
        await b.expect_imm(51, 1, timeout=10)


async def test_request_size_and_fields_checked(provider: str) -> None:
    """A request shorter than ABI 4's is refused; a longer one (a newer caller) is served
    when what this shim does not know is zero and refused when it is not; an unknown op,
    an immediate on a read and a non-zero trigger.reserved are refused; none posts."""
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        dst = b.register(np.zeros(4096, dtype=np.uint8))
        src = a.register(np.full(4096, 3, dtype=np.uint8))
        rid, _ = a._remote(dst.descriptor)
        n = a._n
        f = _native.shim().f
        h = n._handle()
        out = ctypes.c_uint64()
        imm = 60
        base = dict(mr_id=src.id or 0, remote_id=rid, length=4096, imm=imm)

        def submit(req: ctypes.Structure, size: int) -> None:
            ctypes.c_uint32.from_buffer(req).value = size  # the first field, whatever the struct
            rc = f.afs_submit_req(h, ctypes.cast(ctypes.byref(req), ctypes.POINTER(_native.Request)), out)
            _native.shim().check(rc, "submit", provider)

        full = ctypes.sizeof(_native.Request)
        with pytest.raises(errors.InvalidArgument, match="at least 184"):
            submit(_request(_native.OP_WRITE, **base), full - 8)

        class Newer(ctypes.Structure):  # a caller built against a header with one more field
            _fields_ = [("req", _native.Request), ("extra", ctypes.c_uint64)]

        newer = Newer()
        for name, value in base.items():
            setattr(newer.req, name, value)
        newer.req.op = _native.OP_WRITE
        newer.extra = 1
        with pytest.raises(errors.Unsupported, match="does not know"):
            submit(newer, ctypes.sizeof(Newer))
        with pytest.raises(errors.InvalidArgument, match="unknown op 99"):
            submit(_request(99, **base), full)
        with pytest.raises(errors.InvalidArgument, match="no immediate"):
            submit(_request(_native.OP_READ, **base), full)
        bad_trigger = _request(_native.OP_WRITE, **base)
        bad_trigger.trigger.reserved = 1
        with pytest.raises(errors.InvalidArgument, match="reserved"):
            submit(bad_trigger, full)
        with pytest.raises(errors.OperationTimeout):  # nothing above was posted
            await b.expect_imm(imm, 1, timeout=0.3)
        newer.extra = 0  # zero past what this shim knows: served
        submit(newer, ctypes.sizeof(Newer))
        await b.expect_imm(imm, 1, timeout=10)


async def test_done_carries_when_the_write_was_first_posted(provider: str) -> None:
    """afs_completion.first_post_ns (Event.first_post_ns): the CLOCK_MONOTONIC time its first
    work request was posted, between the call and its completion."""
    async with afabric.Engine(provider) as a, afabric.Engine(provider) as b:
        dst = b.register(np.zeros(4096, dtype=np.uint8))
        src = a.register(np.full(4096, 5, dtype=np.uint8))
        posts: collections.deque[tuple[int, int]] = collections.deque()
        raw.record_first_posts(a, posts)
        before = time.monotonic_ns()
        await asyncio.wait_for(a.write(src, dst.descriptor, 4096), 10)
        after = time.monotonic_ns()
        assert len(posts) == 1 and before <= posts[0][1] <= after, (before, list(posts), after)
