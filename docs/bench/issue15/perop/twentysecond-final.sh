#!/usr/bin/env bash
# Device, one call: the twenty-second session's tree (.whl-ab/new: signal moderation, refused
# destinations and stalled-post naps of the twenty-first): the standard rows (wheels.sh),
# fabtests' pair.sh fi_rma_bw beside them (shm, tcp;ofi_rxm; 64 KiB W 64, 1 MiB W 16, with and
# without -U), the awaited rows, and `bench trigger` (2000 iterations) shm and tcp twice more.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  local r p s u
  standard_rows new
  for p in shm "tcp;ofi_rxm"; do
    for s in "65536 -W 64" "1048576 -W 16"; do
      for u in "" "-U"; do
        echo "--- pair.sh fi_rma_bw $p $s $u $(date +%T)"
        # shellcheck disable=SC2086 # size and window are two words on purpose
        bash .fabtests/pair.sh fi_rma_bw "$p" $s $u
      done
    done
  done
  awaited_rows new
  for r in 1 2; do
    for p in shm tcp; do
      echo "--- bench trigger $p $(date +%T)"
      run new 120 -m afabric.cli bench trigger --provider $p | grep -E "^triggered|^python "
    done
  done
}

logged "${LOG:-twentysecond-final.log}" rows
