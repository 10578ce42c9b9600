#!/usr/bin/env bash
# The test suite on a fresh Debian/Ubuntu machine, as root: installs what the chosen suite
# needs (apt packages, a virtual environment with the package and its test extra), then runs
# pytest with the remaining arguments.
#
#   bash tests/run.sh [PYTEST ARGS]        the default suite, the README's test command: a C
#       compiler, libfabric, python3-venv and iproute2 from apt, the package with its test
#       extra in .venv. What needs more skips, each test saying which option brings it: the
#       Soft-RoCE guest, the torch-based tests, the fresh-Debian run.
#   bash tests/run.sh --rxe [PYTEST ARGS]  also the verbs provider's Soft-RoCE qemu guest
#       (tests/rxe: qemu, busybox, kmod, rdma-core, perftest; a few hundred packages) and
#       rdma-core's <infiniband/verbs.h> for the ABI comparison; those tests may not skip.
#   bash tests/run.sh --all [PYTEST ARGS]  everything, and nothing of it may skip: --rxe, torch
#       (CPU build), the 2.x libfabric run, the two-rail network namespaces, the fresh-Debian
#       run and the docs site (its `docs` extra, and Debian's chromium to render it). This is
#       what CI runs (.ci/run).
#   --dry-run   print what the chosen suite installs and requires, then stop (nothing is installed).
# The GPU suites install their own, on a GPU machine: tests/gpu/run_*.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

rxe=0 all=0 dry=0
while [ $# -gt 0 ]; do
    case "$1" in
        --rxe) rxe=1 ;;
        --all) all=1 rxe=1 ;;
        --dry-run) dry=1 ;;
        *) break ;;
    esac
    shift
done

has_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }

# what each suite needs: apt packages, pip requirements beyond the test extra, and the
# AFABRIC_REQUIRE_* switches that turn a skip into a failure
apt_want=(gcc libc6-dev libfabric-dev libfabric1 python3-venv iproute2)  # iproute2: two-rail tests
extras=test  # the package's extras installed with it
pip_want=()
require=()
if [ "$rxe" = 1 ]; then
    # the Soft-RoCE qemu guest (tests/rxe) that tests the verbs provider, and rdma-core's
    # verbs.h, which building does not need (the provider carries its own declarations):
    # tests/test_build.py compares the provider built against it with ours
    apt_want+=(qemu-system-x86 busybox-static kmod rdma-core ibverbs-utils ibverbs-providers perftest
               libibverbs-dev)
    require+=(AFABRIC_REQUIRE_RXE=1 AFABRIC_REQUIRE_VERBS_ABI=1)
fi
if [ "$all" = 1 ]; then
    # torch: the CPU build (tests register CPU tensors; kvcache, weights, moe)
    pip_want+=("torch==2.13.0")
    # the 2.x libfabric run (tests/libfabric2.py), the two-rail network-namespace tests
    # (tests/netns.py, tests/hosts.py), and the README's install line in a fresh debootstrap'd Debian
    # (tests/fresh_machine.sh, about 2 minutes with its root cached in ~/.cache/afabric;
    # needs Debian's mirror and PyPI)
    require+=(AFABRIC_REQUIRE_LIBFABRIC2=1 AFABRIC_REQUIRE_NETNS=1 AFABRIC_FRESH_MACHINE=1)
    # the docs site (tests/test_docs.py): built strictly, rendered in a real browser
    apt_want+=(chromium)
    extras=test,docs
    require+=(AFABRIC_REQUIRE_DOCS=1)
fi

if [ "$dry" = 1 ]; then
    echo "apt: ${apt_want[*]}"
    echo "pip: -e .[$extras] ./examples/plugin_sockets ${pip_want[*]}"
    echo "require: ${require[*]}"
    exit 0
fi

need_apt=()
for p in "${apt_want[@]}"; do
    case "$p" in  # a compiler or a libfabric from elsewhere will do
        gcc) command -v cc >/dev/null 2>&1 && continue ;;
        libfabric-dev) [ -f /usr/include/rdma/fabric.h ] && continue ;;
        libfabric1) ldconfig -p | grep -q 'libfabric.so.1 ' && continue ;;
        python3-venv) python3 -c 'import venv, ensurepip' 2>/dev/null && continue ;;
        iproute2) { command -v ip && command -v tc; } >/dev/null 2>&1 && continue ;;
        libibverbs-dev) [ -f /usr/include/infiniband/verbs.h ] && continue ;;
    esac
    has_pkg "$p" || need_apt+=("$p")
done
if [ ${#need_apt[@]} -gt 0 ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
# examples/plugin_sockets: a third-party provider plugin the tests discover exactly as users
# would install one
$py -m pip install -q -e ".[$extras]" "${pip_want[@]}"
$py -m pip install -q ./examples/plugin_sockets

[ ${#require[@]} -eq 0 ] || export "${require[@]}"
exec $py -m pytest -q -ra "$@"
