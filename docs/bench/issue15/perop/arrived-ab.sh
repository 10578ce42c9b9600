#!/usr/bin/env bash
# Device: an adaptive tcp target kept awake by the bytes it takes in (new: AFP_ACTIVITY_ARRIVED,
# the provider's wait object ready before a progress call and drained by it) against the
# target napping between plain writes that nothing counted (old, 691a47f), alternated twice:
# `bench p2p --fabtests` (tcp), `bench trigger` (tcp), idle tcp engines; shm once each
# (no change expected: shm counts remote writes).
set -uo pipefail
ROOT=$PWD; OUT=${OUT:-/tmp}; PY=${PY:-python3}
. docs/bench/issue15/perop/wheels.sh
install_wheels old new
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  for r in 1 2; do
    for w in old new; do
      echo "=== p2p tcp $w $(date +%T)"
      run "$w" 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 \
        --fabtests "$ROOT/.fabtests" --provider tcp | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
      echo "--- trigger tcp $w $(date +%T)"
      run "$w" 60 -m afabric.cli bench trigger --quick --provider tcp | grep -E "^triggered"
      echo "--- idle tcp $w"; run "$w" 30 docs/bench/issue15/idle.py tcp
    done
  done
  for w in old new; do
    echo "=== p2p shm $w $(date +%T)"
    run "$w" 150 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider shm | sed -n '/^op /,/^awaited/p' | grep -v "^read\|^paged"
  done
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/arrived-ab.log"
