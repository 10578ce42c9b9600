#!/usr/bin/env bash
# Device, one call: the twenty-second session's tree (.whl-ab/new: signal moderation, refused
# destinations and stalled-post naps of the twenty-first): the standard rows (wheels.sh),
# fabtests' pair.sh fi_rma_bw beside them (shm, tcp;ofi_rxm; 64 KiB W 64, 1 MiB W 16, with and
# without -U), the awaited rows, and `bench trigger` (2000 iterations) shm and tcp twice more.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  standard_rows new
  fi_pairs
  awaited_rows new
  trigger_rows new
}

logged "${LOG:-twentysecond-final.log}" rows
