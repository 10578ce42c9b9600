#!/usr/bin/env bash
# new wheel: bench p2p with FI_HMEM off (default now) vs forced on (AFABRIC_OFI_HMEM=1), alternated; old wheel once.
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-$ROOT/device-out}; mkdir -p "$OUT"; PY=${PY:-python3}
for v in old new; do rm -rf /tmp/site-$v; "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-$v .whl-ab/$v/afabric-*.whl 2>&1 | grep -v "Running pip"; done
chmod +x .fabtests/* 2>/dev/null
run() { local name=$1 t=$2; shift 2; echo "=== $name $(date +%T)" >> "$OUT/ab2.log"; timeout "$t" "$@" >> "$OUT/ab2.log" 2>&1; echo "rc=$?" >> "$OUT/ab2.log"; }
for p in shm tcp; do
  PYTHONPATH=/tmp/site-new run "$p new (no hmem)" 170 "$PY" -P -m afabric.cli bench p2p --provider $p --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests $ROOT/.fabtests
  PYTHONPATH=/tmp/site-new AFABRIC_OFI_HMEM=1 run "$p new hmem forced" 170 "$PY" -P -m afabric.cli bench p2p --provider $p --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests $ROOT/.fabtests
done
PYTHONPATH=/tmp/site-new run "cma new" 120 "$PY" -P -m afabric.cli bench p2p --provider cma --quick --sizes 4K,64K,1M,16M --repeat 3
for p in shm tcp; do PYTHONPATH=/tmp/site-new run "idle $p new" 30 "$PY" docs/bench/issue15/idle.py $p; done
echo done >> "$OUT/ab2.log"
