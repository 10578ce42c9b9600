#!/usr/bin/env bash
# The C reference beside afabric, one run: fabtests' pair.sh fi_rma_bw (shm, tcp;ofi_rxm; 64 KiB
# at window 64, 1 MiB at window 16, each also with -U, delivery complete) from .fabtests, then
# `bench p2p --quick --sizes 4K,64K,1M --repeat 3 --fabtests` (shm, tcp) with the wheel
# .whl-ab/new. The local-pair-*.log files; on this machine: PY=.venv/bin/python OUT=/tmp.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  fi_pairs
  p2p_rows new 4K,64K,1M
}

logged "${LOG:-pair-rows.log}" rows
