#!/usr/bin/env bash
# Device, one call: trigbench.py (the triggered write's latency split into bump -> seen and
# seen -> first post) with the wheel .whl-ab/new, shm and tcp, 3000 iterations: the bench's
# writer (its store clocked in C, afs_watcher_store) and the one before it (`numpy`: a numpy
# store timed from Python), alternated twice; then `bench trigger` (2000 iterations) of each.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  local r p w
  for r in 1 2; do
    for p in shm tcp; do
      for w in c numpy; do
        echo "--- $p writer $w $(date +%T)"
        run new 120 docs/bench/issue15/perop/trigbench.py $p 3000 $w | grep -E "^trig|^whole|^bump|^seen|^store|^slow"
      done
    done
  done
  for p in shm tcp; do
    echo "--- bench trigger $p $(date +%T)"
    run new 120 -m afabric.cli bench trigger --provider $p | grep -E "^triggered|^python "
  done
}

logged trigbench.log rows
