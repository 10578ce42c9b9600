"""The example third-party plugin (examples/plugin_sockets, distribution afabric-sockets) is
found and used exactly like a first-party provider: through its installed entry point,
with nothing special-cased, and it moves real bytes (libfabric's sockets provider)."""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest

import afabric
from afabric import errors, registry

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "plugin_sockets"
DIST = "afabric-sockets"


@pytest.fixture(autouse=True)
def _no_shm_leaks() -> Iterator[None]:
    """Replaces conftest's check here: nothing in this module opens a shm endpoint, so a
    /dev/shm file appearing meanwhile belongs to a concurrent run, which this test must
    neither be blamed for nor delete."""
    yield


def _installed_matches_source() -> bool:
    """Installed, and its module is the example's current source (not a stale copy)."""
    try:
        metadata.distribution(DIST)
    except metadata.PackageNotFoundError:
        return False
    importlib.invalidate_caches()
    spec = importlib.util.find_spec("afabric_sockets")  # what `import` would load (editable too)
    if spec is None or spec.origin is None:
        return False
    source = EXAMPLE / "afabric_sockets" / "__init__.py"
    return Path(spec.origin).read_bytes() == source.read_bytes()


@pytest.fixture(scope="session")
def sockets_plugin() -> metadata.Distribution:
    """The example plugin, installed as a user would install it (pip, from its directory).

    `--no-build-isolation` is tried first (offline, fast) but needs the `wheel` package
    next to setuptools < 70.1 (here: setuptools 65.5 without wheel fails with "invalid
    command 'bdist_wheel'", and the example asks for setuptools>=68 anyway); the isolated
    build gets its setuptools from the configured index.
    """
    if not _installed_matches_source():
        base = [sys.executable, "-m", "pip", "install", "--no-deps", "--force-reinstall", "--quiet"]
        failures = []
        for extra in (["--no-build-isolation"], []):
            proc = subprocess.run(
                [*base, *extra, str(EXAMPLE)], capture_output=True, text=True, timeout=240, check=False
            )
            if proc.returncode == 0:
                break
            failures.append(f"pip install {' '.join(extra)}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        else:
            pytest.fail(f"cannot install {EXAMPLE}:\n" + "\n".join(failures))
        registry.clear_cache()
    assert _installed_matches_source()
    return metadata.distribution(DIST)


def test_declared_by_an_entry_point_like_first_party(sockets_plugin: metadata.Distribution) -> None:
    eps = [ep for ep in sockets_plugin.entry_points if ep.group == registry.GROUP]
    assert [(ep.name, ep.value) for ep in eps] == [("sockets", "afabric_sockets:sockets")]
    first_party = [ep for ep in metadata.distribution("afabric").entry_points if ep.group == registry.GROUP]
    assert {ep.name for ep in first_party} == {"efa", "tcp", "shm", "verbs", "nvlink", "cma"}
    registry.clear_cache()
    (entry,) = registry.entries()["sockets"]
    assert (entry.distribution, entry.value) == (DIST, "afabric_sockets:sockets")
    (tcp,) = registry.entries()["tcp"]
    assert type(entry) is type(tcp) and type(entry.entry_point) is type(tcp.entry_point)


def test_probed_like_first_party(sockets_plugin: metadata.Distribution) -> None:
    registry.clear_cache()
    a = registry.probe("sockets")
    assert a.available, a.reason
    assert a.distribution == DIST and a.spec is not None
    assert a.spec.priority == 0 and a.spec.fabric_provider == "sockets"
    assert a.provider == "sockets" and a.nics
    spec, sentence = registry.resolve("sockets")
    assert spec is a.spec and sentence.startswith("using sockets (")
    assert registry.resolve("auto")[0].name != "sockets"  # priority 0: asked for only


@pytest.fixture
async def pair(sockets_plugin: metadata.Distribution) -> AsyncIterator[tuple[afabric.Engine, afabric.Engine]]:
    # A lost completion fails in 10 s rather than the default 20.
    a = afabric.Engine("sockets", op_timeout=10)
    try:
        b = afabric.Engine("sockets", op_timeout=10)
    except BaseException:
        await a.aclose()
        raise
    try:
        yield a, b
    finally:
        await a.aclose()
        await b.aclose()


async def test_write_with_immediate_and_send_recv(pair: tuple[afabric.Engine, afabric.Engine]) -> None:
    a, b = pair
    for eng in (a, b):
        assert eng.provider == "sockets"
        assert eng.fabric_provider == "sockets"
        assert eng.provider_choice.startswith("using sockets")

    n = 1 << 20
    dst = np.zeros(n, dtype=np.uint8)
    src = np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8)
    rmr, smr = b.register(dst), a.register(src)
    desc = afabric.MrDesc.from_bytes(bytes(rmr.descriptor))  # as a peer would receive it
    assert desc.provider == "sockets"

    # one-sided write with an immediate: counted only once the data is in place
    imm = b.alloc_imm()
    await a.write(smr, desc, n // 2, src_offset=0, dst_offset=n // 2, imm=imm)
    await b.expect_imm(imm, 1, timeout=30)
    assert np.array_equal(dst[n // 2 :], src[: n // 2])
    assert not dst[: n // 2].any()
    # the initiator's own completion is not an arrival there
    with pytest.raises(errors.OperationTimeout):
        await a.expect_imm(imm, 1, timeout=0.5)

    # two-sided, both ways
    await a.send(afabric.Address.from_bytes(bytes(b.address)), b"ping from a")
    assert await b.recv_bytes() == b"ping from a"
    await b.send(a.address, b"pong from b")
    assert await a.recv_bytes() == b"pong from b"
