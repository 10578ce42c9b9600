#!/usr/bin/env bash
# Device: which CPU pairs make the awaited write faster (placement.py, cma, target unpinned):
# the caches each CPU shares, then the loop on one CPU and the worker on each of several.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for c in 0 1 2 3 4 5; do
    for i in /sys/devices/system/cpu/cpu$c/cache/index*; do
      echo "cpu$c L$(cat $i/level) $(cat $i/type) $(cat $i/size) shared $(cat $i/shared_cpu_list)"
    done
  done
  P=docs/bench/issue15/placement.py
  for r in 1 2; do
    for pair in "2 3" "3 2" "4 5" "5 4" "2 1" "3 4" "2 6" "2 12" "6 7" "12 13"; do
      set -- $pair
      run new 60 $P cma "$1" "$2" -
    done
  done
  for r in 1 2; do
    for pair in "2 3" "3 4" "2 6"; do
      set -- $pair
      run new 60 $P shm "$1" "$2" -
    done
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/placement2.log"
