#!/usr/bin/env bash
# Device, one call: the eighteenth session's final tree (.whl-ab/new): the standard rows
# (wheels.sh), then `bench trigger` (2000 iterations) shm and tcp twice more.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  standard_rows new
  trigger_rows new
}

logged eighteenth-final.log rows
