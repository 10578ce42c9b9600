#!/usr/bin/env bash
# Device, one call: the worker's turns while operations are armed on watchers, by phase
# (take+fire, posts, provider poll, rest), from an experiment build: `git apply
# docs/bench/issue15/perop/turns.patch`, then a wheel of it in .whl-ab/turns (AFS_TURNS=1
# prints the histogram when the worker stops); with it, trigbench.py shm and tcp, and the
# machine's clock source and the cost of a clock reading.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels turns

rows() {
  local p
  cat /sys/devices/system/clocksource/clocksource0/current_clocksource
  grep -m1 "model name" /proc/cpuinfo
  uname -r
  "$PY" -c "
import time
c=time.monotonic_ns; s=[]
for _ in range(100000):
    t=c(); s.append(c()-t)
s.sort(); print('clock pair p50', s[50000], 'p99', s[99000])"
  for p in shm tcp; do
    echo "--- $p $(date +%T)"
    AFS_TURNS=1 run turns 120 docs/bench/issue15/perop/trigbench.py $p 3000 2>&1 |
      grep -E "TURNS|^whole|^bump|^seen|^triggered"
  done
}

logged turns.log rows
