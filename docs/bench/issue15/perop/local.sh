#!/usr/bin/env bash
# The 2-core development machine's counterpart of dev.sh (run from the checkout, its .venv
# built from it; FABTESTS defaults to ../shared/tools/fabtests): the per-operation cost,
# `bench p2p --pattern fixed` for cma, shm and tcp against fi_rma_bw, shm with spin polling
# and with the span pattern, the triggered write, idle engines.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-$ROOT/.venv/bin/python}
FT=${FABTESTS:-$ROOT/../shared/tools/fabtests}
p2p() { timeout 400 "$PY" -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 "$@"; }
{
  echo "=== per-op $(date +%T)"
  for r in 1 2; do for p in cma shm; do timeout 120 "$PY" docs/bench/issue15/perop/perop.py $p; done; done
  for p in cma shm tcp; do
    echo "=== p2p fixed $p $(date +%T)"; p2p --provider $p --pattern fixed --fabtests "$FT"
  done
  echo "=== p2p fixed shm, spin polling $(date +%T)"; p2p --provider shm --pattern fixed --polling spin --fabtests "$FT"
  echo "=== p2p span shm $(date +%T)"; p2p --provider shm --pattern span --fabtests "$FT"
  echo "=== trigger $(date +%T)"; timeout 200 "$PY" -m afabric.cli bench trigger --quick
  for p in shm tcp cma; do timeout 30 "$PY" docs/bench/issue15/idle.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/${LOG:-local.log}"
