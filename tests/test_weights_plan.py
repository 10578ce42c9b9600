"""The routing plan without any transfer: every destination byte is written exactly once
and holds what it should (TP splits, fused projections, fp8 tiles and their scales,
uneven and nested shards, replicas), the load is balanced, plans survive serialization,
and shard boxes match torch DTensor's own arithmetic. A plan as a peer could send it
(random, truncated, bit-flipped, fields of the wrong type or size, .npy headers declaring
2**40 elements) is decoded or refused with InvalidArgument, never anything else, and
nothing it declares is allocated before it is checked."""

from __future__ import annotations

import io
import json
import math
import tracemalloc
import zipfile
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afabric import errors
from afabric import weights as aw
from afabric.weights.meta import chunk_range
from afabric.weights.quant import dequantize_blocks, quantize_blocks

torch = pytest.importorskip("torch", reason="torch is not installed (bash tests/run.sh --all installs it)")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

BLOCKS = [4, 8]


def _full(sources: list[aw.SourceParam], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {s.name: torch.randn(s.shape, generator=g).to(getattr(torch, s.dtype)) for s in sources}


def _expected(t: aw.DestTensor, full: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The bytes a destination tensor (and its scales) should hold, from whole weights."""
    x = torch.cat([full[p.source][tuple(slice(a, b) for a, b in p.box)] for p in t.parts], dim=0)
    if t.fp8:
        data, scale = quantize_blocks(x, t.block)
        return [data.view(torch.uint8).reshape(-1), scale.view(torch.uint8).reshape(-1)]
    return [x.to(getattr(torch, t.dtype)).contiguous().view(torch.uint8).reshape(-1)]


def _verify(plan: aw.Plan, layouts: list[aw.RankLayout], full: dict[str, torch.Tensor]) -> None:
    plan.check_coverage(layouts)
    bufs = aw.simulate(plan, full)
    for i, lay in enumerate(layouts):
        for t in lay.tensors:
            slot = lay.slots[t.name]
            want = _expected(t, full)
            got = bufs[i][slot.offset : slot.offset + t.nbytes]
            assert torch.equal(got, want[0]), f"rank {i} {t.name}"
            if t.fp8:
                got_s = bufs[i][slot.scale_offset : slot.scale_offset + t.scale_nbytes]
                assert torch.equal(got_s, want[1]), f"rank {i} {t.name} scales"


@st.composite
def meshes(draw: Any, ndim: int, trainers: list[int]) -> tuple[tuple[int, ...], tuple[aw.Placement, ...]]:
    n = len(trainers)
    if n >= 4 and n % 2 == 0 and draw(st.booleans()):
        shape: tuple[int, ...] = (2, n // 2)
    else:
        shape = (n,)
    pl = st.sampled_from([aw.Placement(), *(aw.Placement(d) for d in range(ndim))])
    return shape, tuple(draw(pl) for _ in shape)


@st.composite
def scenarios(draw: Any) -> tuple[list[aw.SourceParam], list[aw.RankLayout], list[int], int, aw.PlanOptions]:
    n_tr = draw(st.integers(1, 5))
    trainers = list(range(n_tr))
    fp8 = draw(st.booleans())
    block = draw(st.sampled_from(BLOCKS))
    tp = draw(st.integers(1, 3))
    n_inf = tp * draw(st.integers(1, 2))
    sources: list[aw.SourceParam] = []
    per_rank: list[list[aw.DestTensor]] = [[] for _ in range(tp)]
    for k in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["col", "row", "fused", "whole1d"]))
        if kind == "whole1d":
            shape: tuple[int, ...] = (draw(st.integers(1, 40)),)
        else:
            unit = block * tp if fp8 else tp
            shape = (unit * draw(st.integers(1, 4)), unit * draw(st.integers(1, 4)))
        mshape, pls = draw(meshes(len(shape), trainers))
        src_dtype = draw(st.sampled_from(["bfloat16", "float32"]))
        names = [f"p{k}"] if kind != "fused" else [f"p{k}a", f"p{k}b"]
        for nm in names:
            sources.append(aw.SourceParam(nm, shape, src_dtype, mshape, tuple(trainers), pls))
        dtype = aw.FP8 if fp8 and kind != "whole1d" else draw(st.sampled_from(["bfloat16", "float32"]))
        for t in range(tp):
            if kind == "whole1d":
                parts = (aw.Part(names[0], ((0, shape[0]),)),)
            elif kind == "col":  # column-parallel: rows split
                parts = (aw.Part(names[0], (chunk_range(0, shape[0], tp, t), (0, shape[1]))),)
            elif kind == "row":  # row-parallel: columns split
                parts = (aw.Part(names[0], ((0, shape[0]), chunk_range(0, shape[1], tp, t))),)
            else:  # fused, e.g. gate/up: each split by rows, stacked
                parts = tuple(aw.Part(nm, (chunk_range(0, shape[0], tp, t), (0, shape[1]))) for nm in names)
            per_rank[t].append(aw.DestTensor(f"t{k}", dtype, parts, block=block))
    layouts = [aw.RankLayout(per_rank[i % tp], n_tr) for i in range(n_inf)]
    opts = aw.PlanOptions(
        max_task_bytes=draw(st.sampled_from([4096, 1 << 20])),
        direct_min_bytes=draw(st.sampled_from([1, 64, 1 << 20])),
        unshard=draw(st.sampled_from(["auto", "always"])),
    )
    return sources, layouts, trainers, draw(st.integers(0, 1000)), opts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_plans_cover_every_byte_once(sc: Any) -> None:
    sources, layouts, trainers, seed, opts = sc
    plan = aw.build_plan(sources, layouts, trainers=trainers, options=opts)
    _verify(plan, layouts, _full(sources, seed))
    again = aw.Plan.from_bytes(plan.to_bytes())
    assert again.tasks == plan.tasks and again.groups == plan.groups
    assert torch.equal(torch.from_numpy(again.writes), torch.from_numpy(plan.writes))
    # every task is prepared by a rank that can: a holder of its slice, or (unsharded) a mesh rank
    for t in plan.tasks:
        src = plan.sources[t.param]
        if t.unshard:
            assert t.sender in src.mesh_ranks
        else:
            held = src.box_of(t.sender)
            assert all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(t.box, held, strict=True))


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9), st.integers(1, 6), st.integers(1, 40))
def test_balanced_when_every_rank_can_send(trainers: int, params: int, rows: int) -> None:
    """Unsharded parameters may go to any mesh rank: the busiest rank sends at most the
    average plus one task's bytes (greedy, largest first)."""
    tr = list(range(trainers))
    shard0 = (aw.Placement(0),)
    sources = [aw.SourceParam(f"p{k}", (rows * (k + 1), 64), "bfloat16", (trainers,), tuple(tr), shard0)
               for k in range(params)]  # fmt: skip
    layout = aw.RankLayout([aw.DestTensor(s.name, "bfloat16", (aw.Part(s.name, ((0, s.shape[0]), (0, 64))),))
                           for s in sources], trainers)  # fmt: skip
    plan = aw.build_plan(sources, [layout, layout], trainers=tr, options=aw.PlanOptions(unshard="always"))
    sent = plan.sent_bytes()
    biggest = max(t.data_bytes * 2 for t in plan.tasks)
    assert max(sent.values()) <= sum(sent.values()) / trainers + biggest


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(0, 23), min_size=1, max_size=3),
    st.sampled_from([(1,), (2,), (3,), (4,), (2, 2), (3, 2), (2, 3)]),
    st.data(),
)
def test_shard_boxes_match_dtensor(shape: list[int], mesh_shape: tuple[int, ...], data: Any) -> None:
    """Uneven, empty and nested shards: the boxes are the ones DTensor itself computes."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    dims = [data.draw(st.sampled_from([None, *range(len(shape))])) for _ in mesh_shape]
    n = math.prod(mesh_shape)
    src = aw.SourceParam("p", tuple(shape), "bfloat16", mesh_shape, tuple(range(n)),
                        tuple(aw.Placement(d) for d in dims))  # fmt: skip
    placements = [Replicate() if d is None else Shard(d) for d in dims]
    for i in range(n):
        coord = src.coordinate(i)
        local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
        box = src.box_at(coord)
        assert tuple(b - a for a, b in box) == tuple(local)
        if all(local):
            assert tuple(a for a, _ in box) == tuple(offset)


def test_fp8_error_bound() -> None:
    w = (torch.randn(40, 24) * 3).to(torch.bfloat16)
    data, scale = quantize_blocks(w, 8)
    err = (dequantize_blocks(data, scale, 8) - w.float()).abs()
    tile_max = (
        w.float().abs().reshape(5, 8, 3, 8).amax(dim=(1, 3)).repeat_interleave(8, 0).repeat_interleave(8, 1)
    )
    assert (err <= tile_max / 16 + 1e-6).all()  # e4m3 rounds to 3 mantissa bits


def test_bad_layouts_refused() -> None:
    src = aw.SourceParam("a", (12, 16), "bfloat16", (2,), (0, 1), (aw.Placement(0),))
    with pytest.raises(errors.InvalidArgument, match="not a multiple"):
        aw.DestTensor(
            "t", aw.FP8, (aw.Part("a", ((0, 6), (0, 16))), aw.Part("a", ((6, 12), (0, 16)))), block=4
        )
    with pytest.raises(errors.InvalidArgument, match="block boundary"):
        aw.DestTensor("t", aw.FP8, (aw.Part("a", ((2, 12), (0, 16))),), block=4)
    lay = aw.RankLayout([aw.DestTensor("t", "bfloat16", (aw.Part("b", ((0, 1), (0, 16))),))], 2)
    with pytest.raises(errors.InvalidArgument, match="no training parameter"):
        aw.build_plan([src], [lay], trainers=[0, 1])
    lay = aw.RankLayout([aw.DestTensor("t", "bfloat16", (aw.Part("a", ((0, 13), (0, 16))),))], 2)
    with pytest.raises(errors.InvalidArgument, match="outside"):
        aw.build_plan([src], [lay], trainers=[0, 1])
    lay = aw.RankLayout([aw.DestTensor("t", aw.FP8, (aw.Part("a", ((4, 12), (0, 16))),), block=4)], 2)
    with pytest.raises(errors.InvalidArgument, match="allow unshard"):
        aw.build_plan([src], [lay], trainers=[0, 1], options=aw.PlanOptions(unshard="never"))
    with pytest.raises(errors.InvalidArgument, match="not a weight transfer plan"):
        aw.Plan.from_bytes(b"junk")


@pytest.mark.parametrize("preset", sorted(aw.PRESETS))
def test_presets_plan_small_scale(preset: str) -> None:
    """Each preset's real layouts (two layers) plan, cover every byte (16 -> 8 ranks) and
    survive serialization."""
    from afabric.weights.models import with_layers

    m = with_layers(aw.PRESETS[preset], 2)
    tr = list(range(16))
    layouts = aw.inference_layouts(m, 8, 8, 16, fp8=True)
    plan = aw.build_plan(aw.fsdp_sources(m, tr), layouts, trainers=tr)
    plan.check_coverage(layouts)
    s = plan.summary()
    assert s["max_sent"] <= 1.1 * s["mean_sent"]
    again = aw.Plan.from_bytes(plan.to_bytes())  # the checks of a plan from a peer accept it
    assert again.tasks == plan.tasks and again.groups == plan.groups
    assert np.array_equal(again.writes, plan.writes)


# ---- decoding a plan that came from a peer ----


def _example_plans() -> list[bytes]:
    """Plans with every feature the format carries: tp splits, fp8 tiles and scales,
    unsharded and direct slices, several groups, replicas."""
    tr = [0, 1, 2]
    plain = aw.SourceParam("w", (12, 16), "bfloat16", (3,), tuple(tr), (aw.Placement(0),))
    whole = aw.SourceParam("b", (10,), "float32", (1,), (1,), (aw.Placement(),))
    lays = [
        aw.RankLayout([
            aw.DestTensor("w", "bfloat16", (aw.Part("w", (chunk_range(0, 12, 2, i), (0, 16))),)),
            aw.DestTensor("b", "float32", (aw.Part("b", ((0, 10),)),)),
        ], 3)
        for i in range(2)
    ]  # fmt: skip
    fp8_src = aw.SourceParam("f", (16, 8), "bfloat16", (3,), tuple(tr), (aw.Placement(1),))
    fp8 = aw.RankLayout([aw.DestTensor("f", aw.FP8, (aw.Part("f", ((0, 16), (0, 8))),), block=4)], 3)
    return [
        aw.build_plan([plain, whole], lays, trainers=tr).to_bytes(),
        aw.build_plan([fp8_src, plain, whole], [fp8, lays[0]], trainers=tr).to_bytes(),
    ]


PLANS = _example_plans()
FUZZ = settings(max_examples=150, deadline=None)


def _decoded_or_refused(blob: Any) -> None:
    """Only InvalidArgument may leave the decoder; a plan it returns answers every question
    without error and survives another round trip."""
    try:
        plan = aw.Plan.from_bytes(blob)
    except errors.InvalidArgument:
        return
    plan.summary()
    for t in plan.tasks:
        plan.writes_of(t)
    for r in plan.inference:
        plan.arrivals(r)
    for r in plan.trainers:
        plan.tasks_of(r)
        plan.trainer_slot(r)
    again = aw.Plan.from_bytes(plan.to_bytes())
    assert again.tasks == plan.tasks and again.groups == plan.groups


def _unpack(blob: bytes) -> tuple[Any, Any]:
    with np.load(io.BytesIO(blob)) as z:
        return np.array(z["writes"]), json.loads(bytes(z["meta"]).decode())


def _pack(writes: Any, meta: Any) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, writes=writes, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    return buf.getvalue()


def _paths(v: Any, at: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON value (dict keys, list indices), the root first."""
    out = [at]
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else []
    for k, child in items:
        out += _paths(child, (*at, k))
    return out


_WRONG = st.one_of(
    st.none(), st.booleans(), st.floats(), st.text(max_size=6),
    st.sampled_from([-1, 0, 1, 3, 2**31, 2**40, 2**62, 2**63, 2**64, -(2**63), 10**30]),
    st.integers(), st.lists(st.integers(-2, 20), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip


@FUZZ
@given(st.binary(max_size=2048))
def test_plan_decoder_random_bytes(blob: bytes) -> None:
    _decoded_or_refused(blob)


@FUZZ
@given(st.sampled_from(PLANS), st.data())
def test_plan_decoder_mutated_bytes(blob: bytes, data: Any) -> None:
    """Truncated, bit-flipped, overwritten: the zip's structure, the .npy headers, the data."""
    how = data.draw(st.sampled_from(["truncate", "flip", "overwrite"]))
    at = data.draw(st.integers(0, len(blob) - 1))
    if how == "truncate":
        out = blob[:at]
    elif how == "flip":
        out = bytearray(blob)
        for pos in [at, *data.draw(st.lists(st.integers(0, len(blob) - 1), max_size=3))]:
            out[pos] ^= 1 << data.draw(st.integers(0, 7))
        out = bytes(out)
    else:
        out = blob[:at] + data.draw(st.binary(min_size=1, max_size=16)) + blob[at + 1 :]
    _decoded_or_refused(out)


@FUZZ
@given(st.sampled_from(PLANS), st.data())
def test_plan_decoder_mutated_fields(blob: bytes, data: Any) -> None:
    """A well-formed archive whose metadata or write table lies: fields of the wrong type,
    huge or negative numbers, off by one, list items dropped or repeated."""
    writes, meta = _unpack(blob)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_paths(meta)[1:]))
        parent = meta
        for k in path[:-1]:
            parent = parent[k]
        old, key = parent[path[-1]], path[-1]
        how = data.draw(st.sampled_from(["wrong", "nudge", "drop", "repeat"]))
        if how == "nudge" and isinstance(old, int) and not isinstance(old, bool):
            parent[key] = old + data.draw(st.sampled_from([-1, 1]))
        elif how == "drop" and isinstance(parent, list):
            del parent[key]
        elif how == "repeat" and isinstance(parent, list):
            parent.append(old)
        else:
            parent[key] = data.draw(_WRONG)
    if writes.size and data.draw(st.booleans()):
        row, col = data.draw(st.integers(0, writes.shape[0] - 1)), data.draw(st.integers(0, 4))
        writes[row, col] = data.draw(st.sampled_from([-1, 2**62, 2**63 - 1, -(2**63), writes[row, col] + 1]))
    if data.draw(st.booleans()):
        writes = data.draw(st.sampled_from([
            writes.astype("float64"), writes.astype("int32"), writes.astype(">i8"), writes.reshape(-1),
            writes[:, :4], writes[:-1], writes.T,
        ]))  # fmt: skip
    _decoded_or_refused(_pack(writes, meta))


def _npy(descr: Any, shape: Any, fortran: Any = False) -> bytes:
    """A .npy header written by hand (any values, as a peer could)."""
    text = f"{{'descr': {descr!r}, 'fortran_order': {fortran!r}, 'shape': {shape!r}, }}"
    text += " " * (-(len(text) + 11) % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + len(text).to_bytes(2, "little") + text.encode()


def _zip(members: dict[str, bytes], method: int | None = None) -> bytes:

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, raw in members.items():
            z.writestr(name, raw, compress_type=method)
    return buf.getvalue()


def _meta_member() -> bytes:
    with np.load(io.BytesIO(PLANS[0])) as z:
        meta = np.array(z["meta"])
    buf = io.BytesIO()
    np.save(buf, meta)
    return buf.getvalue()


@FUZZ
@given(
    st.sampled_from(["<i8", "<f8", ">i8", "|O", "<i4", "|u1", [("a", "<i8")], "x", 3]),
    st.one_of(
        st.tuples(st.integers(-2, 2**41), st.integers(-2, 6)),
        st.sampled_from([(2**40, 5), (-1, 5), (5,), (1, 5, 1), ("a",), (2**63, 2**63), 7]),
    ),
    st.sampled_from([False, True, 1, None]),
    st.binary(max_size=200),
)
def test_plan_decoder_hand_written_npy_headers(descr: Any, shape: Any, fortran: Any, body: bytes) -> None:
    _decoded_or_refused(_zip({"writes.npy": _npy(descr, shape, fortran) + body, "meta.npy": _meta_member()}))


@pytest.mark.parametrize("member", ["writes", "meta"])
@pytest.mark.parametrize("numel", [2**40, 2**24])
def test_a_header_declaring_many_elements_allocates_nothing(member: str, numel: int) -> None:
    """A few hundred bytes whose header declares 2**40 elements (8 TiB of int64) or 2**24
    rows (640 MiB, which numpy's loader would really allocate) are refused with a small
    peak allocation."""
    members = {"writes.npy": _npy("<i8", (0, 5)), "meta.npy": _meta_member()}
    if member == "writes":
        members["writes.npy"] = _npy("<i8", (numel, 5)) + bytes(80)
    else:
        members["meta.npy"] = _npy("|u1", (numel,)) + b"{}"
    blob = _zip(members)
    tracemalloc.start()
    try:
        with pytest.raises(errors.InvalidArgument) as refused:
            aw.Plan.from_bytes(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes allocated to refuse a {len(blob)}-byte plan"
    assert "declares" in str(refused.value)


def test_only_what_savez_writes_is_taken() -> None:
    writes = io.BytesIO()
    np.save(writes, np.zeros((0, 5), dtype=np.int64))
    good = {"writes.npy": writes.getvalue(), "meta.npy": _meta_member()}
    cases = {
        "compressed": _zip(good, zipfile.ZIP_DEFLATED),
        "members": _zip({**good, "extra.npy": b""}),
        "members ": _zip({"writes.npy": good["writes.npy"]}),
        "not bytes": "a plan",
    }
    for why, blob in cases.items():
        with pytest.raises(errors.InvalidArgument, match=why.strip()):
            aw.Plan.from_bytes(blob)  # type: ignore[arg-type]
