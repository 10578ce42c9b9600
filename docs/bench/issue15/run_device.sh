#!/usr/bin/env bash
# Final device run: fi_rma_bw / fi_rdm_pingpong (fabtests 1.17) and afabric before/after, alternately.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
R=$PWD; F=$R/.fabtests; chmod +x $F/* 2>/dev/null
echo "host $(hostname) cpus $(nproc) $(date -Is) $(python3 -V)"; grep -E "Seccomp:|CapEff" /proc/self/status
for b in before after; do python3 -m pip install -q --no-deps --no-index --target /tmp/site-$b .whl-perf/$b/*.whl 2>&1 | grep -v "Running pip" ; done
cd /tmp
for prov in shm "tcp;ofi_rxm"; do
  ap=$([ "$prov" = shm ] && echo shm || echo tcp)
  for s in 4096 65536 1048576 16777216; do
    w=$([ $s -le 65536 ] && echo 64 || echo 16)
    echo "FI $ap $s W=$w $(bash $F/pair.sh fi_rma_bw "$prov" $s -W $w)"
    for b in before after; do
      PYTHONPATH=/tmp/site-$b timeout 120 python3 $R/docs/bench/issue15/pbench.py $ap adaptive $s one,span | sed "s/^/[$b] /"
    done
  done
  echo "PP $ap 8 $(bash $F/pair.sh fi_rdm_pingpong "$prov" 8)"
  for b in before after; do
    PYTHONPATH=/tmp/site-$b timeout 90 python3 $R/docs/bench/issue15/pbench.py $ap adaptive 4096 one lat | sed "s/^/[$b] /"
  done
done
echo "== afabric bench p2p --fabtests (after)"
PYTHONPATH=/tmp/site-after timeout 240 python3 -m afabric.cli bench p2p --provider shm --quick --sizes 4K,64K,1M,16M --repeat 3 --fabtests $F --json $OUT/p2p-shm.json
