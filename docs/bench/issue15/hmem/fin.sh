#!/usr/bin/env bash
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-python3}
rm -rf /tmp/site-new; "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-new .whl-ab/new/afabric-*.whl 2>&1 | grep -v "Running pip"
chmod +x .fabtests/*
for p in shm tcp; do
  echo "=== $p $(date +%T)"
  PYTHONPATH=/tmp/site-new timeout 170 "$PY" -P -m afabric.cli bench p2p --provider $p --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests $ROOT/.fabtests
done 2>&1 | tee $OUT/fin.log
