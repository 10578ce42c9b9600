"""What `bash tests/run.sh` installs before pytest can start, by suite (its --dry-run):
the default suite only what it runs (before: 326 more apt packages, qemu among them, and a
1.2 GB environment with torch, for every run); the Soft-RoCE guest's packages with --rxe;
everything with --all, which CI runs, requiring exactly what it required before (the guest,
the verbs ABI comparison, libfabric 2.x, the two-rail namespaces, the fresh-Debian run).
And the test extra's version ranges: a mirror a release behind satisfies them."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
HEAVY_APT = {"qemu-system-x86", "busybox-static", "kmod", "rdma-core", "ibverbs-utils", "ibverbs-providers",
             "perftest", "libibverbs-dev"}  # fmt: skip
CI_REQUIRES = {"AFABRIC_REQUIRE_RXE=1", "AFABRIC_REQUIRE_VERBS_ABI=1", "AFABRIC_REQUIRE_LIBFABRIC2=1",
               "AFABRIC_REQUIRE_NETNS=1", "AFABRIC_FRESH_MACHINE=1", "AFABRIC_REQUIRE_DOCS=1"}  # fmt: skip


def plan(*options: str) -> dict[str, set[str]]:
    proc = subprocess.run(
        ["bash", "tests/run.sh", *options, "--dry-run"], cwd=ROOT, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    out = {}
    for line in proc.stdout.splitlines():
        key, _, rest = line.partition(":")
        out[key] = set(rest.split())
    assert set(out) == {"apt", "pip", "require"}, proc.stdout
    return out


def test_default_suite_installs_only_what_it_runs() -> None:
    default = plan()
    assert {"gcc", "libfabric-dev", "python3-venv"} <= default["apt"], default
    assert not default["apt"] & HEAVY_APT, default["apt"] & HEAVY_APT
    assert not any(p.startswith("torch") for p in default["pip"]), default["pip"]
    assert default["require"] == set(), "the default suite requires nothing it does not install"


def test_rxe_and_all_install_the_rest_and_ci_requires_as_before() -> None:
    rxe, full = plan("--rxe"), plan("--all")
    assert rxe["apt"] >= HEAVY_APT, rxe
    assert rxe["require"] == {"AFABRIC_REQUIRE_RXE=1", "AFABRIC_REQUIRE_VERBS_ABI=1"}, rxe
    assert full["apt"] >= HEAVY_APT and full["require"] == CI_REQUIRES, full
    assert {"torch==2.13.0", ".[test,docs]"} <= full["pip"], full["pip"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "exec bash tests/run.sh --all\n" in ci, ci


def test_test_extra_pins_what_a_mirror_a_release_behind_has() -> None:
    tomllib = pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    reqs = {r.name: r.specifier for r in map(Requirement, extra)}
    # pytest-asyncio 1.5.0 is the newest release as this is written; 1.4.0 has the
    # pytest_asyncio_loop_factories hook tests/conftest.py implements
    assert reqs["pytest-asyncio"].contains("1.4.0"), reqs["pytest-asyncio"]
    assert not reqs["pytest-asyncio"].contains("2.0.0")
    assert "torch" not in reqs
