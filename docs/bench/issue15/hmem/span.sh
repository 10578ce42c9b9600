#!/usr/bin/env bash
# shm: the C reproduction (afabric's libfabric setup in fi_rma_bw's loop) over one buffer vs
# a 128 MiB span, fi_rma_bw, and afabric's raw/Python loops over one buffer vs the span.
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
rm -rf /tmp/site-new; "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-new .whl-ab/new/afabric-*.whl 2>&1 | grep -v "Running pip"
chmod +x .fabtests/* ${REPRO:-.exp/shmrepro}
for size in 65536 1048576; do
  W=64; N=20000; [ $size -ge 1048576 ] && W=16 && N=4000
  slots=$(( 134217728 / size ))
  for r in 1 2; do
    timeout 60 ${REPRO:-.exp/shmrepro} -S $size -W $W -c 2,4 -n $N
    timeout 60 ${REPRO:-.exp/shmrepro} -S $size -W $W -c 2,4 -n $N -s $slots
    taskset -c 2,4 .fabtests/pair.sh fi_rma_bw shm $size -W $W
    PYTHONPATH=/tmp/site-new ITERS=$N timeout 100 "$PY" -P docs/bench/issue15/hmem/one.py $size 1 $W 2>&1 | tail -1
    PYTHONPATH=/tmp/site-new ITERS=$N timeout 100 "$PY" -P docs/bench/issue15/hmem/one.py $size $slots $W 2>&1 | tail -1
  done
done 2>&1 | tee $OUT/span.log
