#!/usr/bin/env bash
# Device run behind BENCHMARKS.md's "cma copy threads" table (issue 15): afabric bench p2p
# --fabtests for cma and shm (each alternates its rows with libfabric shm's fi_rma_bw), cma
# at 1 MiB / 16 MiB with 512 KiB parts and with one copier (the path before the threads),
# cmabw.c for reference, and an idle cma engine's CPU after large copies.
# From the checkout's root, with the wheel in .whl/ and fabtests 1.17 in .fabtests/:
#   bash docs/bench/issue15/run_cma_threads.sh     (OUT: where the logs go, default /tmp)
# (cma_idle.py and cmabw.c are taken from this script's folder: copy the three together.)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
R=$PWD; D=$(cd "$(dirname "$0")" && pwd); F=$R/.fabtests; O=${OUT:-/tmp}; chmod +x "$F"/* 2>/dev/null
echo "host $(hostname) cpus $(nproc) $(date -Is) $(python3 -V) wheel: $(ls .whl)"
# SITE: an afabric already installed there (e.g. a wheel with this branch's cma library
# dropped in), instead of installing .whl/*.whl
[ -n "${SITE:-}" ] || python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=${SITE:-/tmp/site}
grep -qa pthread_create $PYTHONPATH/afabric_cma/libafabric_cma.so || { echo "not the copy-threads build"; exit 1; }
cd /tmp
B="python3 -m afabric.cli bench p2p --quick --repeat 3"
echo "== cma"; timeout 240 $B --provider cma --sizes 4K,64K,1M,16M --fabtests "$F" 2>&1 | tee "$O/cma.txt"
echo "== shm"; timeout 240 $B --provider shm --sizes 4K,64K,1M,16M --fabtests "$F" 2>&1 | tee "$O/shm.txt"
echo "== cma 512K parts"; AFABRIC_CMA_MIN_PART=512K timeout 60 $B --provider cma --sizes 1M,16M 2>&1 | grep -E "^(write|read|paged) " | tee "$O/cma512.txt"
echo "== cma one copier"; AFABRIC_CMA_THREADS=1 timeout 60 $B --provider cma --sizes 1M,16M 2>&1 | grep -E "^(write|read|paged) " | tee "$O/cma1.txt"
echo "== idle"; timeout 30 python3 "$D/cma_idle.py"
echo "== cmabw"; (cc -O2 -std=c11 -pthread -Wall -o /tmp/cmabw "$D/cmabw.c" && timeout 60 /tmp/cmabw) 2>&1 | tee "$O/cmabw.txt"
echo "done $(date -Is)"
