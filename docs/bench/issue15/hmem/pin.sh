#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
rm -rf /tmp/site-new; "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-new .whl-ab/new/afabric-*.whl 2>&1 | grep -v "Running pip"
chmod +x ${REPRO:-.exp/shmrepro} .fabtests/*
{
lscpu | grep -E "^CPU\(s\)|NUMA|Thread|Core|Socket|L3"
for r in 1 2; do
echo "-- repro unpinned / pinned 2,4 / pinned 2,3"
timeout 60 ${REPRO:-.exp/shmrepro} -S 65536 -W 64 -n 20000
timeout 60 ${REPRO:-.exp/shmrepro} -S 65536 -W 64 -n 20000 -c 2,4
timeout 60 ${REPRO:-.exp/shmrepro} -S 65536 -W 64 -n 20000 -c 2,3
echo "-- fi_rma_bw unpinned"
.fabtests/pair.sh fi_rma_bw shm 65536
echo "-- afabric workers pinned 2 / 4 (raw loop thread and Python unpinned)"
PYTHONPATH=/tmp/site-new WCPU=2 TCPU=4 ITERS=20000 timeout 100 "$PY" -P docs/bench/issue15/hmem/one.py 65536 1 64 2>&1 | tail -2
echo "-- afabric workers pinned 2 / 4, process on 2,4,6"
PYTHONPATH=/tmp/site-new WCPU=2 TCPU=4 ITERS=20000 timeout 100 taskset -c 2,4,6 "$PY" -P docs/bench/issue15/hmem/one.py 65536 1 64 2>&1 | tail -2
done
} 2>&1 | grep -v "refused FI_WAIT" | tee $OUT/pin.log
