"""afabric.moe without a GPU: configuration checks and buffer sizing, the strict parser of
the setup message (property tests: round trips, and random or mutated bytes never raise
anything but ControlMessageError), and the torch routing reference and test cases the GPU
tests (tests/gpu/test_moe.py) rely on."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from afabric.errors import InvalidArgument
from afabric.moe import ControlMessageError, MoeConfig, PeerInfo, buffer_sizes, control

from .gpu import moe_reference as ref

torch = pytest.importorskip("torch")

DECODE = dict(max_tokens=128, num_experts=256, experts_per_token=8, hidden=7168, world_size=2, in_dtype="fp8")


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> None:
    """Nothing here opens an endpoint (replaces conftest's check)."""


# ---------------------------------------------------------------- config and sizing


def test_decode_sizes() -> None:
    cfg = MoeConfig(**DECODE)  # type: ignore[arg-type]
    assert cfg.experts_per_rank == 128
    assert cfg.scales_per_token == 56
    # N·T·min(R, E/N): two sources of 128 tokens, each at most 8 times on this rank
    assert cfg.expert_capacity == 2 * 128 * 8
    lay = cfg.slot_layout()
    assert lay.seg_x == 7168 and lay.seg_scales == 56 * 4
    assert lay.row_bytes % 16 == 0 and lay.row_bytes >= 7168 + 224
    assert lay.off_experts >= 16 and lay.off_weights >= lay.off_experts + 4 * 128 * 8
    assert lay.off_rows >= lay.off_weights + 4 * 128 * 8
    assert lay.slot_bytes >= lay.private_bytes(128)
    assert cfg.combine_slot_bytes >= 128 * 7168 * 2
    sizes = buffer_sizes(cfg, proxy_peers=0)
    assert sizes.host_pinned == 0
    assert sizes.device_staging >= 2 * 2 * (lay.slot_bytes + cfg.combine_slot_bytes)
    assert buffer_sizes(cfg, proxy_peers=1).host_pinned > 0


def test_capacity_bound_is_tight() -> None:
    """The bound holds for the worst routing and is reached by it."""
    for n, t, e, k in [(2, 4, 8, 3), (4, 3, 8, 4), (2, 5, 4, 4), (1, 6, 5, 2)]:
        cfg = MoeConfig(max_tokens=t, num_experts=e, experts_per_token=k, hidden=16, world_size=n)
        # every source sends every token to its first min(k, E/N) experts on rank 0, rest elsewhere
        per = min(k, cfg.experts_per_rank)
        rows = []
        for _ in range(n):
            row = list(range(per)) + [x for x in range(cfg.experts_per_rank, e)][: k - per]
            row += [-1] * (k - len(row))
            rows.append(torch.tensor([row] * t, dtype=torch.int32))
        got = sum(ref.route(cfg, rows, 0).counts)
        assert got == cfg.expert_capacity


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_experts": 255}, "multiple of world_size"),
        ({"hidden": 7170}, "multiple of 16"),
        ({"experts_per_token": 33}, "experts_per_token"),
        ({"experts_per_token": 0}, "experts_per_token"),
        ({"in_dtype": "fp16"}, "in_dtype"),
        ({"out_dtype": "int8"}, "out_dtype"),
        ({"scale_block": 100}, "scale_block"),
        ({"world_size": 65, "num_experts": 65 * 4}, "world_size"),
        ({"node_of": (0,)}, "node_of"),
        ({"node_of": (0, -1)}, "node_of"),
        ({"max_private_tokens": 129}, "max_private_tokens"),
        ({"max_tokens": True}, "max_tokens"),
    ],
)
def test_config_rejects(change: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        MoeConfig(**{**DECODE, **change})  # type: ignore[arg-type]


def test_fingerprint_and_nodes() -> None:
    a = MoeConfig(**DECODE)  # type: ignore[arg-type]
    assert a.nodes == (0, 0) and a.same_node(0, 1)
    b = MoeConfig(**{**DECODE, "node_of": (0, 1)})  # type: ignore[arg-type]
    assert not b.same_node(0, 1)
    assert a.fingerprint() != b.fingerprint()
    assert a.fingerprint() == MoeConfig(**DECODE).fingerprint()  # type: ignore[arg-type]
    c = MoeConfig(**{**DECODE, "max_private_tokens": 32})  # type: ignore[arg-type]
    assert c.private_tokens == 32 and c.fingerprint() != a.fingerprint()


# ---------------------------------------------------------------- the setup message

_infos = st.builds(
    PeerInfo,
    rank=st.integers(0, 6),
    world=st.just(7),
    node=st.integers(0, 0xFFFFFFFF),
    fingerprint=st.binary(min_size=16, max_size=16),
    staging_bytes=st.integers(0, (1 << 64) - 1),
    ipc_handle=st.sampled_from([b"", bytes(range(64))]),
    address=st.binary(max_size=64),
    descs=st.lists(st.binary(min_size=1, max_size=80), max_size=3).map(tuple),
)


@given(_infos)
def test_roundtrip(info: PeerInfo) -> None:
    assert control.parse(info.encode()) == info


@given(st.binary(max_size=300))
def test_random_bytes_only_raise_control_errors(data: bytes) -> None:
    with contextlib.suppress(ControlMessageError):
        control.parse(data)


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(_infos, st.data())
def test_mutations_only_raise_control_errors(info: PeerInfo, data: st.DataObject) -> None:
    blob = bytearray(info.encode())
    for _ in range(data.draw(st.integers(1, 4))):
        op = data.draw(st.sampled_from(["flip", "cut", "extend"]))
        if op == "flip" and blob:
            i = data.draw(st.integers(0, len(blob) - 1))
            blob[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del blob[data.draw(st.integers(0, len(blob))) :]
        else:
            blob += data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = control.parse(bytes(blob))
    except ControlMessageError:
        return
    assert out.encode() == bytes(blob)  # whatever parses, parses exactly


def test_parser_rejects_specific() -> None:
    good = PeerInfo(1, 2, 0, b"f" * 16, 4096, bytes(64), b"addr", (b"d1", b"d2"))
    blob = good.encode()
    with pytest.raises(ControlMessageError, match="magic"):
        control.parse(b"XXXXX" + blob[5:])
    with pytest.raises(ControlMessageError, match="version"):
        control.parse(blob[:5] + bytes([9]) + blob[6:])
    with pytest.raises(ControlMessageError, match="trailing"):
        control.parse(blob + b"\0")
    with pytest.raises(ControlMessageError, match="truncated"):
        control.parse(blob[:-1])
    with pytest.raises(ControlMessageError, match="bytes"):
        control.parse("text")  # type: ignore[arg-type]
    with pytest.raises(ControlMessageError, match="IPC handle"):
        PeerInfo(0, 2, 0, b"f" * 16, 0, b"short")
    with pytest.raises(ControlMessageError, match="rank"):
        PeerInfo(2, 2, 0, b"f" * 16, 0)


def test_check_peers() -> None:
    cfg = MoeConfig(**DECODE)  # type: ignore[arg-type]
    fp = cfg.fingerprint()
    infos = [PeerInfo(r, 2, 0, fp, 1) for r in range(2)]
    control.check_peers(infos, 2, fp, cfg.nodes)
    with pytest.raises(ControlMessageError, match="configured differently"):
        control.check_peers(
            [infos[0], dataclasses.replace(infos[1], fingerprint=b"x" * 16)], 2, fp, cfg.nodes
        )
    with pytest.raises(ControlMessageError, match="from rank"):
        control.check_peers(infos[::-1], 2, fp, cfg.nodes)
    with pytest.raises(ControlMessageError, match="node"):
        control.check_peers([infos[0], dataclasses.replace(infos[1], node=3)], 2, fp, cfg.nodes)
    with pytest.raises(ControlMessageError, match="world"):
        control.check_peers(infos[:1], 2, fp, cfg.nodes)


# ---------------------------------------------------------------- the torch reference


@pytest.mark.parametrize(("scenario", "in_dtype"), list(itertools.product(ref.SCENARIOS, ["bf16", "fp8"])))
def test_cases_and_routes(scenario: str, in_dtype: str) -> None:
    cfg = MoeConfig(max_tokens=24, num_experts=12, experts_per_token=3, hidden=64, world_size=3,
                    in_dtype=in_dtype, scale_block=32)  # fmt: skip
    case = ref.make_case(cfg, scenario, seed=5)
    assert len(case.x) == 3
    total = 0
    for r in range(3):
        idx = case.topk_idx[r]
        n = idx.shape[0]
        assert case.x[r].shape == (n, 64) and case.topk_weights[r].shape == (n, 3) and n <= 24
        for row in idx.tolist():
            ids = [e for e in row if e >= 0]
            assert len(ids) == len(set(ids)) and all(e < 12 for e in ids)  # distinct, in range
        if in_dtype == "fp8":
            sc = case.scales[r]
            assert sc is not None and sc.shape == (n, 2)
    for r in range(3):
        inbox = ref.route(cfg, case.topk_idx, r)
        assert sum(inbox.counts) <= cfg.expert_capacity
        for e, pairs in enumerate(inbox.pairs):
            for s, t in pairs:
                assert r * 4 + e in case.topk_idx[s][t].tolist()
        total += sum(inbox.counts)
    assert total == sum(int((i >= 0).sum()) for i in case.topk_idx)  # nothing lost, nothing twice
    if scenario == "empty_rank":
        assert case.x[0].shape[0] == 0
    if scenario == "one_expert":
        assert ref.route(cfg, case.topk_idx, 0).counts[0] == sum(x.shape[0] for x in case.x)
    if scenario == "sparse_experts":
        counts = [c for r in range(3) for c in ref.route(cfg, case.topk_idx, r).counts]
        assert all(c == 0 for e, c in enumerate(counts) if e % 3)
    if scenario == "same_rank":
        for idx in case.topk_idx:
            for row in idx.tolist():
                assert len({e // 4 for e in row if e >= 0}) == 1


def test_reference_combine() -> None:
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    idx = torch.tensor([[0, 2], [1, -1]], dtype=torch.int32)
    w = torch.tensor([[0.5, 0.25], [1.0, 9.0]])
    f = torch.tensor([1.0, 2.0, 4.0])
    out = ref.combine(values, idx, w, f)
    # token 0: 0.5*1 + 0.25*4 = 1.5; token 1: 1.0*2 (the -1 entry counts nothing)
    assert torch.equal(out, torch.tensor([[1.5, 3.0], [6.0, 8.0]]))


def test_dequantize() -> None:
    x = torch.ones(2, 4).to(torch.float8_e4m3fn)
    s = torch.tensor([[2.0, 3.0], [0.5, 1.0]])
    assert torch.equal(ref.dequantize(x, s, 2), torch.tensor([[2.0, 2.0, 3.0, 3.0], [0.5, 0.5, 1.0, 1.0]]))
    assert ref.dequantize(torch.zeros(0, 4).to(torch.float8_e4m3fn), torch.zeros(0, 2), 2).shape == (0, 4)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_capacity_holds_for_any_routing(data: st.DataObject) -> None:
    """Whatever the routing (distinct ids per token, any masking), no rank receives more
    (token, expert) entries than expert_capacity: the receive buffers never overflow."""
    n = data.draw(st.integers(1, 4))
    e_local = data.draw(st.integers(1, 5))
    k = data.draw(st.integers(1, min(6, n * e_local)))
    t = data.draw(st.integers(1, 6))
    cfg = MoeConfig(max_tokens=t, num_experts=n * e_local, experts_per_token=k, hidden=16, world_size=n)
    rows = []
    for _ in range(n):
        toks = data.draw(st.integers(0, t))
        idx = []
        for _ in range(toks):
            ids = data.draw(st.lists(st.integers(0, n * e_local - 1), min_size=k, max_size=k, unique=True))
            idx.append([e if data.draw(st.booleans()) or k == 1 else -1 for e in ids])
        rows.append(torch.tensor(idx, dtype=torch.int32).reshape(toks, k))
    for r in range(n):
        assert sum(ref.route(cfg, rows, r).counts) <= cfg.expert_capacity


def test_paths_and_arguments() -> None:
    from afabric.moe.alltoall import _check_args, _proxy_peers

    one_node = MoeConfig(**{**DECODE, "world_size": 4})  # type: ignore[arg-type]
    two_nodes = MoeConfig(**{**DECODE, "world_size": 4, "node_of": (0, 0, 1, 1)})  # type: ignore[arg-type]
    assert _proxy_peers(one_node, 1, "auto") == []
    assert _proxy_peers(one_node, 1, "proxy") == [0, 2, 3]
    assert _proxy_peers(two_nodes, 1, "auto") == [2, 3]
    assert _proxy_peers(two_nodes, 2, "auto") == [0, 1]
    with pytest.raises(InvalidArgument, match="one node"):
        _proxy_peers(two_nodes, 0, "nvlink")
    _check_args(one_node, 3, "auto", 0, 30.0)
    for args, match in [
        ((one_node, 4, "auto", 0, 1.0), "rank"),
        ((one_node, True, "auto", 0, 1.0), "rank"),
        ((one_node, 0, "ib", 0, 1.0), "path"),
        ((one_node, 0, "auto", 1 << 15, 1.0), "tag"),
        ((one_node, 0, "auto", 0, 0), "timeout"),
        (("cfg", 0, "auto", 0, 1.0), "MoeConfig"),
    ]:
        with pytest.raises(InvalidArgument, match=match):
            _check_args(*args)  # type: ignore[arg-type]


# ---------------------------------------------------------------- kernel arguments by name


def test_kernel_arguments_by_name() -> None:
    """Launch arguments are set by kernels.cu's parameter names (read from the source), so
    a name that is not a parameter, or a parameter left out, fails at setup, on any machine."""
    from afabric.moe.kernels import KERNELS, Args, kernel_params

    params = kernel_params()
    assert set(params) == set(KERNELS)
    assert params["dispatch_send"][:8] == ("topk", "idx64", "weights", "x", "x_stride", "scales", "s_stride",
                                           "n_tok")  # fmt: skip
    assert params["dispatch_small"][:17] == params["dispatch_send"]  # send's arguments first
    assert params["combine_recv"][3] == "n_tok" and len(params["dispatch_small"]) == 27
    a = Args("combine_recv", params["combine_recv"])
    values = {name: i + 1 for i, name in enumerate(a.names)}
    a.set(**values)
    assert list(a.words) == list(range(1, 10))
    a.words[a.span("n_tok", "n_tok")] = 77
    assert a.words[a.at("n_tok")] == 77 and a.words[a.at("H")] == values["H"]
    with pytest.raises(ValueError, match=r"missing \['timeout_ns'\], unknown \['timeout'\]"):
        a.set(**{k: v for k, v in values.items() if k != "timeout_ns"}, timeout=1)
