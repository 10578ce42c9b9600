#!/usr/bin/env bash
# Device or here: py-spy profiles (--native) of 64 lanes of 8 B writes (woken.py), shm and
# cma, the loop thread's stacks summed by profagg.py. Needs py-spy (`pip install py-spy`; on
# the device carry its static binary as .exp/py-spy, with .whl-ab/new).
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
SPY=${SPY:-.exp/py-spy}
if [ -d .whl-ab/new ]; then install_wheels new; export PYTHONPATH=/tmp/site-new; fi
for p in shm cma; do
  echo "=== $p $(date +%T)"
  timeout 150 "$SPY" record --native -r 997 --format raw -o "$OUT/prof-$p.txt" -- \
    "$PY" -P docs/bench/issue15/perop/woken.py $p 8 600000 2>&1 | grep -E "^WOKEN|Samples"
  "$PY" docs/bench/issue15/perop/profagg.py "$OUT/prof-$p.txt" | head -50
done
