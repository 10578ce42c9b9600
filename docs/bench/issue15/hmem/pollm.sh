#!/usr/bin/env bash
# shm 64 KiB / 1 MiB, one buffer: afabric raw/py by writer/target polling, old vs new wheel; C repro without immediates.
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
for v in old new; do rm -rf /tmp/site-$v; "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-$v .whl-ab/$v/afabric-*.whl 2>&1 | grep -v "Running pip"; done
chmod +x ${REPRO:-.exp/shmrepro}
{
timeout 60 ${REPRO:-.exp/shmrepro} -S 65536 -W 64 -c 2,4 -n 20000 -i 0
timeout 60 ${REPRO:-.exp/shmrepro} -S 65536 -W 64 -c 2,4 -n 20000 -i 1
for cfg in "adaptive adaptive" "adaptive spin" "spin adaptive" "spin spin"; do
  set -- $cfg
  for v in old new; do
    echo "-- $v writer $1 target $2"
    PYTHONPATH=/tmp/site-$v POLL=$1 TPOLL=$2 ITERS=20000 timeout 100 "$PY" -P docs/bench/issue15/hmem/one.py 65536 1 64 2>&1 | tail -2
  done
done
for v in old new; do
  echo "-- $v 1 MiB adaptive"
  PYTHONPATH=/tmp/site-$v ITERS=4000 timeout 100 "$PY" -P docs/bench/issue15/hmem/one.py 1048576 1 16 2>&1 | tail -2
done
} 2>&1 | tee $OUT/pollm.log
