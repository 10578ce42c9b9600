#!/usr/bin/env bash
# One device call (GPU machine): the per-operation A/B (main before / after the drain change),
# `bench p2p --pattern fixed` for cma, shm and tcp against fi_rma_bw, shm with spin polling and
# with the span pattern, the triggered write, idle engines. Expects .whl-ab/{old,new} and
# .fabtests (a copy of ../shared/tools/fabtests) in the repository root.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
p2p() { PYTHONPATH=/tmp/site-new timeout 170 "$PY" -P -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 "$@"; }
{
  echo "=== per-op A/B $(date +%T)"
  for r in 1 2; do for w in old new; do for p in cma shm; do
    echo -n "$w "; PYTHONPATH=/tmp/site-$w timeout 60 "$PY" -P docs/bench/issue15/perop/perop.py $p
  done; done; done
  for p in cma shm tcp; do
    echo "=== p2p fixed $p $(date +%T)"; p2p --provider $p --pattern fixed --fabtests "$ROOT/.fabtests"
  done
  echo "=== p2p fixed shm, spin polling $(date +%T)"; p2p --provider shm --pattern fixed --polling spin --fabtests "$ROOT/.fabtests"
  echo "=== p2p span shm $(date +%T)"; p2p --provider shm --pattern span --fabtests "$ROOT/.fabtests"
  echo "=== trigger $(date +%T)"; PYTHONPATH=/tmp/site-new timeout 120 "$PY" -P -m afabric.cli bench trigger --quick
  for p in shm tcp cma; do PYTHONPATH=/tmp/site-new timeout 30 "$PY" -P docs/bench/issue15/idle.py $p; done
  echo "=== end $(date +%T)"
} 2>&1 | tee "$OUT/dev.log"
