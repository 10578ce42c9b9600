#!/usr/bin/env bash
# A/B of the look that yields (2-CPU machines: the loop polls tcp and shm writes too, and its
# looks, like the raw loop's, yield the CPU between looks; .whl-ab/old = 251b812, new = the
# change): the awaited write's distribution (latdist.py, shm, tcp, cma) and bench p2p against
# fi_rma_bw (shm, tcp), old and new alternated twice. Here (2-core):
# LOG=local-lookyield-ab.log PY=.venv/bin/python OUT=/tmp bash docs/bench/issue15/perop/lookyield-ab.sh
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh

rows() {
  local w=$1 p
  for p in shm tcp cma; do
    echo "--- latdist $p $w $(date +%T)"
    run "$w" 120 docs/bench/issue15/perop/latdist.py $p | tail -3
  done
  p2p_rows "$w" 4K,64K,1M,16M
}

ab_rounds "${LOG:-lookyield-ab.log}" rows
