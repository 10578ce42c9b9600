#!/usr/bin/env bash
# NIXL (its UCX backend) against afabric on one host, alternated in one run: UCX's cma
# against afabric's cma provider (both: the writer's own process_vm_writev, the target
# idle), UCX's tcp against libfabric tcp. Same pattern both sides: W writes of one size in
# flight (64 below 1 MiB, 16 above), each from and to offset 0 of a buffer of its size, and
# one 8 B write at a time, awaited.
#
#   NIXL_PY     a Python that can import nixl_cu12 (python -m venv /tmp/nixlenv &&
#               /tmp/nixlenv/bin/pip install nixl-cu12); default /tmp/nixlenv/bin/python
#   AFABRIC_PY  a Python with afabric installed; default python3
#   NIXL_HUGEPAGES=1  both sides' buffers 2 MiB-aligned and advised for huge pages
#               (nixl_bw.py; afabric's --hugepages)
#   TLS_EXTRA   appended to UCX_TLS (",cuda_copy" where a GPU is present: NIXL's UCX backend
#               refuses to start without a CUDA transport there)
#   SIZES       default 4K,64K,1M,16M
#
# Usage: bash tools/nixl/compare.sh [ROUNDS]     (docs/performance.md shows its results)
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NIXL_PY=${NIXL_PY:-/tmp/nixlenv/bin/python}
AFABRIC_PY=${AFABRIC_PY:-python3}
SIZES=${SIZES:-4K,64K,1M,16M}
echo "=== $(nproc) CPUs, $(lscpu | sed -n 's/^Model name: *//p'), NIXL_HUGEPAGES=${NIXL_HUGEPAGES:-0}"
for round in $(seq 1 "${1:-2}"); do
  for pair in "cma self,cma,tcp" "tcp self,tcp"; do
    # shellcheck disable=SC2086 # two words on purpose
    set -- $pair
    echo "=== round $round: NIXL UCX_TLS=$2${TLS_EXTRA:-} $(date +%T)"
    (cd /tmp && UCX_TLS=$2${TLS_EXTRA:-} NIXL_LOG_LEVEL=WARN timeout 300 "$NIXL_PY" "$HERE/nixl_bw.py" --sizes "$SIZES") 2>&1 \
      | grep -v " NIXL INFO "
    echo "=== round $round: afabric $1 $(date +%T)"
    # shellcheck disable=SC2086 # an empty flag on purpose
    timeout 300 "$AFABRIC_PY" -m afabric.cli bench p2p --provider "$1" --quick --sizes "$SIZES" --repeat 3 \
      --pattern fixed ${NIXL_HUGEPAGES:+--hugepages} 2>&1 | grep -v "^afabric: [0-9]*/" | sed -n '1,/^awaited/p'
  done
done
