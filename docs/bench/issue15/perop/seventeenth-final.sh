#!/usr/bin/env bash
# Device, one call: spare-ab.sh (the spare transfer, new, against 37e8b28, old), then the
# standard rows (wheels.sh) of the new tree.
set -uo pipefail
bash docs/bench/issue15/perop/spare-ab.sh > /dev/null 2>&1
. docs/bench/issue15/perop/wheels.sh
{
  echo "=== start $(date +%T) $(nproc) CPUs"
  standard_rows new
  echo "=== end $(date +%T)"
} 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/seventeenth-final.log"
