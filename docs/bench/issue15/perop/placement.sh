#!/usr/bin/env bash
# Device: where the threads run against an awaited 8 B write (placement.py): the topology,
# unpinned runs (their spread), then the loop, its worker and the target pinned apart, the
# worker on the loop's SMT sibling, and on another core.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  lscpu | grep -E "Model name|Thread|Core|Socket|NUMA node|MHz"
  for c in 0 1 2 3 8 9; do echo "cpu$c siblings $(cat /sys/devices/system/cpu/cpu$c/topology/thread_siblings_list) core $(cat /sys/devices/system/cpu/cpu$c/topology/core_id)"; done
  P=docs/bench/issue15/placement.py
  sib=$(cut -d, -f2 /sys/devices/system/cpu/cpu2/topology/thread_siblings_list | cut -d- -f2)
  for p in cma shm; do
    for r in 1 2 3; do run new 60 $P $p -1 -1 -; done
    for r in 1 2; do
      run new 60 $P $p 2 3 4,5
      run new 60 $P $p 2 "$sib" 4,5
      run new 60 $P $p 2 6 4,5
      run new 60 $P $p 2 -1 4,5
    done
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/placement.log"
