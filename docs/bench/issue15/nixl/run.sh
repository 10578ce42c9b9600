#!/usr/bin/env bash
# NIXL (UCX) against afabric on one host, alternated in one run: UCX's cma against afabric's
# cma provider (both: the writer's own process_vm_writev), UCX's tcp against libfabric tcp.
# NIXL_PY: a Python with NIXL (python -m venv /tmp/nixlenv && /tmp/nixlenv/bin/pip install
# nixl-cu12); AFABRIC_PY: one with afabric. TLS_EXTRA: appended to UCX_TLS (",cuda_copy"
# where a GPU is present: NIXL's UCX backend refuses to start without a CUDA transport).
# NIXL_HUGEPAGES=1: both sides' buffers 2 MiB-aligned and advised for huge pages (nixl_bw.py;
# afabric's --hugepages). Usage: bash docs/bench/issue15/nixl/run.sh [ROUNDS]
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NIXL_PY=${NIXL_PY:-/tmp/nixlenv/bin/python}
AFABRIC_PY=${AFABRIC_PY:-python3}
SIZES=4K,64K,1M,16M
for round in $(seq 1 "${1:-2}"); do
  for pair in "cma self,cma,tcp" "tcp self,tcp"; do
    # shellcheck disable=SC2086 # two words on purpose
    set -- $pair
    echo "=== round $round: NIXL UCX_TLS=$2${TLS_EXTRA:-} $(date +%T)"
    (cd /tmp && UCX_TLS=$2${TLS_EXTRA:-} NIXL_LOG_LEVEL=WARN timeout 300 "$NIXL_PY" "$HERE/nixl_bw.py" --sizes $SIZES) 2>&1 \
      | grep -v " NIXL INFO "
    echo "=== round $round: afabric $1 $(date +%T)"
    timeout 300 "$AFABRIC_PY" -m afabric.cli bench p2p --provider "$1" --quick --sizes $SIZES --repeat 3 \
      --pattern fixed ${NIXL_HUGEPAGES:+--hugepages} 2>&1 | grep -v "^afabric: [0-9]*/" | sed -n '1,/^awaited/p'
  done
done
