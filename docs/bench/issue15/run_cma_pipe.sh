#!/usr/bin/env bash
# Device run behind BENCHMARKS.md's "cma whole operations in parallel" rows (issue 15): afabric
# bench p2p --fabtests for cma (pipelined build) and shm, each alternating its rows with
# libfabric shm's fi_rma_bw; cma with every operation below the split threshold copied inline
# by the worker (AFABRIC_CMA_ASYNC_AT=1G: the path before, same binary) and with 4 KiB
# inline (8K); an idle cma engine's CPU after pipelined copies.
# From the checkout's root, with this branch's wheel in $E and fabtests 1.17 in .fabtests/:
#   E=<dir with the wheel and this folder's scripts> bash run_cma_pipe.sh   (OUT: logs)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
R=$PWD; F=$R/.fabtests; O=${OUT:-/tmp}; chmod +x "$F"/* 2>/dev/null
python3 -m pip install -q --no-deps --no-index --target /tmp/site "$E"/*.whl || exit 1
export PYTHONPATH=/tmp/site
grep -qa cma_pool_submit /tmp/site/afabric_cma/libafabric_cma.so || { echo "not the pipelined build"; exit 1; }
echo "host $(hostname) cpus $(nproc) $(date -Is) $(python3 -V)"
cd /tmp
B="python3 -m afabric.cli bench p2p --quick --repeat 3"
echo "== cma"; timeout 120 $B --provider cma --sizes 4K,64K,1M,16M --fabtests "$F" 2>&1 | grep -v "^afabric: " | tee "$O/cma.txt"
echo "== shm"; timeout 100 $B --provider shm --sizes 4K,64K,1M,16M --fabtests "$F" 2>&1 | grep -v "^afabric: " | tee "$O/shm.txt"
echo "== cma inline below the split (ASYNC_AT=1G: before)"; AFABRIC_CMA_ASYNC_AT=1G timeout 50 $B --provider cma --sizes 4K,64K 2>&1 | grep -E "^(write|read|paged|many|awaited) " | tee "$O/cma-inline.txt"
echo "== cma 4K inline (ASYNC_AT=8K)"; AFABRIC_CMA_ASYNC_AT=8K timeout 40 $B --provider cma --sizes 4K 2>&1 | grep -E "^(write|read|paged|many|awaited) " | tee "$O/cma-8k.txt"
echo "== idle"; timeout 20 python3 "$E/cma_idle.py" pipe 2>&1 | tee "$O/idle.txt"
echo "done $(date -Is)"
