#!/usr/bin/env bash
# Device, one call: where 64 lanes of awaited writes wait against write_many batches
# (timeline.py) and what gathering the lanes' writes per loop iteration would change
# (coalesce.py, an experiment), shm and tcp, with the wheel .whl-ab/new.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  local a
  for a in "shm 65536" "shm 4096" "tcp 65536"; do
    echo "--- timeline.py $a $(date +%T)"
    run new 120 docs/bench/issue15/perop/timeline.py $a
  done
  for a in "shm 65536" "tcp 65536" "shm 4096"; do
    echo "--- coalesce.py $a $(date +%T)"
    run new 120 docs/bench/issue15/perop/coalesce.py $a
  done
}

logged "${LOG:-nineteenth-lanes.log}" rows
