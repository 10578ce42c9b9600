#!/usr/bin/env bash
# The whole test suite on a fresh Debian/Ubuntu machine, as root: installs everything it
# needs (apt packages, a virtual environment with the package and its test dependencies),
# then runs pytest. This is the README's test command, and .ci/run runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
[ -f /usr/include/rdma/fabric.h ] || need_apt+=(libfabric-dev)
ldconfig -p | grep -q 'libfabric.so.1 ' || need_apt+=(libfabric1)
python3 -c 'import venv, ensurepip' 2>/dev/null || need_apt+=(python3-venv)
{ command -v ip && command -v tc; } >/dev/null 2>&1 || need_apt+=(iproute2)  # two-rail tests
# rdma-core's verbs.h is not needed to build (the verbs provider carries its own
# declarations); tests/test_build.py compares the provider built against it with ours.
[ -f /usr/include/infiniband/verbs.h ] || need_apt+=(libibverbs-dev)
# the Soft-RoCE qemu guest (tests/rxe) that tests the verbs provider
has_pkg() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q 'ok installed'; }
for p in qemu-system-x86 busybox-static kmod rdma-core ibverbs-utils ibverbs-providers perftest; do
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
# torch: the CPU build (tests register CPU tensors); examples/plugin_sockets: a third-party
# provider plugin the tests discover exactly as users would install one.
$py -m pip install -q -e ".[test]" "torch==2.13.0"
$py -m pip install -q ./examples/plugin_sockets

# The docs site (tests/test_docs.py): the package's `docs` extra, read from pyproject.toml so
# the list lives in one place, and a real browser to render the pages (Debian's chromium).
command -v chromium >/dev/null 2>&1 || {
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
}
$py -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["docs"]))' \
    | xargs -d '\n' $py -m pip install -q
export AFABRIC_REQUIRE_DOCS=1

# Neither the 2.x libfabric run (tests/libfabric2.py), the two-rail network-namespace
# tests (tests/netns.py) nor the Soft-RoCE guest (tests/rxe) may be skipped silently here.
export AFABRIC_REQUIRE_LIBFABRIC2=1 AFABRIC_REQUIRE_NETNS=1 AFABRIC_REQUIRE_RXE=1
# Nor the ABI comparison of the verbs declarations with rdma-core's header.
export AFABRIC_REQUIRE_VERBS_ABI=1
# The README's install line in a fresh debootstrap'd Debian (tests/fresh_machine.sh, about
# 2 minutes with its root cached in ~/.cache/afabric; needs Debian's mirror and PyPI).
export AFABRIC_FRESH_MACHINE=1
exec $py -m pytest -q -ra "$@"
