#!/usr/bin/env bash
# Device, one call (twenty-fourth session): does the tcp target's adaptive policy cost the
# 64 KiB row? bench p2p tcp at 4 KiB and 64 KiB with default adaptive polling and with
# `--polling spin` (both processes), and fabtests' pair.sh fi_rma_bw tcp;ofi_rxm 64 KiB W 64
# (and -U), alternated ROUNDS times (default 3). With FIRST=standard, the standard rows
# (wheels.sh) and fabtests' pair rows first. Carry .whl-ab (new) and .fabtests.
# Here (2-core): LOG=local-tcpspin.log PY=.venv/bin/python OUT=/tmp bash docs/bench/issue15/perop/tcpspin.sh
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rounds() {
  local r pol u
  if [ "${FIRST:-}" = standard ]; then standard_rows new; fi_pairs; fi
  for r in $(seq "${ROUNDS:-3}"); do
    for u in "" "-U"; do
      echo "--- pair.sh fi_rma_bw tcp;ofi_rxm 65536 -W 64 $u $(date +%T)"
      # shellcheck disable=SC2086 # -U or nothing
      bash .fabtests/pair.sh fi_rma_bw "tcp;ofi_rxm" 65536 -W 64 $u
    done
    for pol in adaptive spin; do
      echo "=== p2p tcp $pol round $r $(date +%T)"
      run new 200 -m afabric.cli bench p2p --quick --sizes 4K,64K --repeat 3 \
        --fabtests "$ROOT/.fabtests" --provider tcp --polling $pol | grep -E "^op |^write "
    done
  done
}
logged "${LOG:-tcpspin.log}" rounds
