#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-/tmp}; PY=${PY:-python3}
rm -rf /tmp/site-new; "$PY" -m pip install -q --no-deps --no-index --no-compile --target /tmp/site-new .whl-ab/new/afabric-*.whl 2>&1 | grep -v "Running pip"
chmod +x ${REPRO:-.exp/shmrepro}
{
for r in 1 2; do
for o in "-m 0 -x 0" "-m 1 -x 0" "-m 0 -x 1" "-m 1 -x 1"; do timeout 60 ${REPRO:-.exp/shmrepro} -S 65536 -W 64 -n 20000 $o; done
done
cuda=$(ldconfig -p | awk '/libcuda.so.1 /{print $NF; exit}')
echo "libcuda: $cuda"
for r in 1 2; do
echo "-- afabric with libcuda"
PYTHONPATH=/tmp/site-new ITERS=20000 timeout 100 "$PY" -P docs/bench/issue15/hmem/one.py 65536 1 64 2>&1 | tail -1
echo "-- afabric with libcuda hidden"
PYTHONPATH=/tmp/site-new ITERS=20000 timeout 100 unshare -m sh -c "mount --bind /dev/null $cuda && $PY -P docs/bench/issue15/hmem/one.py 65536 1 64" 2>&1 | tail -1
done
} 2>&1 | grep -v "refused FI_WAIT" | tee $OUT/hmem.log
