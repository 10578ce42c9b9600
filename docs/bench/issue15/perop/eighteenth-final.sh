#!/usr/bin/env bash
# Device, one call: the eighteenth session's final tree (.whl-ab/new): the standard rows
# (wheels.sh), then `bench trigger` (2000 iterations) shm and tcp twice more.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  local r p
  standard_rows new
  for r in 1 2; do
    for p in shm tcp; do
      echo "--- bench trigger $p $(date +%T)"
      run new 120 -m afabric.cli bench trigger --provider $p | grep -E "^triggered|^python "
    done
  done
}

logged eighteenth-final.log rows
