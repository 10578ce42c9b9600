set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
R=$PWD; F=$R/.fabtests; O=${OUT:-/tmp}; chmod +x "$F"/*
cd /tmp; B="python3 -m afabric.cli bench p2p --quick --repeat 3"
echo "== cma"; timeout 200 $B --provider cma --sizes 4K,64K,1M,16M --fabtests "$F" 2>&1 | grep -v "^afabric: " | tee "$O/cma2.txt"
echo "== shm"; timeout 200 $B --provider shm --sizes 1M,16M --fabtests "$F" 2>&1 | grep -v "^afabric: " | tee "$O/shm2.txt"
for s in 1M 256K; do echo "== cma split_at $s"; AFABRIC_CMA_SPLIT_AT=$s timeout 60 $B --provider cma --sizes 256K,512K,1M --fabtests "$F" 2>&1 | grep -E "^(op|write|read) " | tee -a "$O/split.txt"; done
echo "== idle"; timeout 30 python3 /tmp/pl/cma_idle.py
