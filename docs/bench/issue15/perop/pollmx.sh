#!/usr/bin/env bash
# Device: which side's naps cost small shm writes in fi_rma_bw's pattern (one buffer).
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
[ -d /tmp/site-new ] || "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-new .whl-ab/new/afabric-*.whl
run() { PYTHONPATH=/tmp/site-new timeout 120 "$PY" -P docs/bench/issue15/pbench.py shm "$@" 4096,65536 one; }
{
  for r in 1 2; do
    TPOLL=adaptive run adaptive
    TPOLL=spin run adaptive
    TPOLL=adaptive run spin
    TPOLL=adaptive WSPIN=1000 run adaptive
    TPOLL=spin run spin
  done
  for i in 1 2 3; do PYTHONPATH=/tmp/site-new timeout 30 "$PY" docs/bench/issue15/idle.py shm; done
} 2>&1 | tee "$OUT/pollmx.log"
