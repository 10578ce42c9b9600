#!/usr/bin/env bash
# Device, one call: the issue's first table again (8 B to 16 MiB: shm with adaptive and with
# spin polling, tcp; fi_rma_bw beside each row), then the per-write rows (awaited_rows), with
# the wheel .whl-ab/new. On the 2-core machine:
# LOG=local-nineteenth-table.log PY=.venv/bin/python OUT=/tmp bash <this script>
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  local p pol
  for p in "shm adaptive" "shm spin" "tcp adaptive"; do
    set -- $p
    echo "=== p2p $1 --polling $2 $(date +%T)"
    run new 300 -m afabric.cli bench p2p --quick --sizes 8,4K,64K,1M,16M --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider "$1" --polling "$2" | sed -n '/^op /,/^awaited/p' \
      | grep -E "^op|^write|^awaited"
  done
  awaited_rows new
}

logged "${LOG:-nineteenth-table.log}" rows
