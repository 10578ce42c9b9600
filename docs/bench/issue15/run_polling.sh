#!/usr/bin/env bash
# Before/after wheels (.whl-perf/{before,after}, as README.md here says) alternated: shm
# 64 KiB/1 MiB/16 MiB with both sides adaptive, tcp 1/16 MiB, idle CPU, 8 B latency.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
R=$PWD; F=$R/.fabtests; chmod +x $F/* 2>/dev/null
cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null | sed 's/^/ptrace_scope /'
for b in before after; do python3 -m pip install -q --no-deps --no-index --target /tmp/site-$b .whl-perf/$b/*.whl 2>&1 | grep -v "Running pip"; done
cd /tmp
for s in 65536 1048576 16777216; do
  w=$([ $s -le 65536 ] && echo 64 || echo 16)
  echo "FI writedata $s W=$w $(bash $F/pair.sh fi_rma_bw shm $s -W $w)"
  for r in 1 2; do for b in before after; do
    PYTHONPATH=/tmp/site-$b TPOLL=adaptive timeout 100 python3 $R/docs/bench/issue15/pbench.py shm adaptive $s one,span | sed "s/^/[$b] /"
  done; done
done
echo "FI tcp 16M $(bash $F/pair.sh fi_rma_bw 'tcp;ofi_rxm' 16777216 -W 16)"
for b in before after; do PYTHONPATH=/tmp/site-$b TPOLL=adaptive timeout 100 python3 $R/docs/bench/issue15/pbench.py tcp adaptive 1048576,16777216 one | sed "s/^/[$b] /"; done
for b in before after; do for p in shm tcp; do PYTHONPATH=/tmp/site-$b python3 $R/docs/bench/issue15/idle.py $p | sed "s/^/[$b] /"; done; done
for b in before after; do PYTHONPATH=/tmp/site-$b timeout 60 python3 $R/docs/bench/issue15/pbench.py shm adaptive 4096 one lat | grep LAT | sed "s/^/[$b] /"; done
