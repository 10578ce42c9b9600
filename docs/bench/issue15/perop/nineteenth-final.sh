#!/usr/bin/env bash
# Device, one call: the nineteenth session's tree (.whl-ab/new): the standard rows
# (wheels.sh; bench p2p now prints its batch column: write_many in fi_rma_bw's pattern),
# then bench p2p shm and tcp once more, for the spread. On the 2-core machine:
# LOG=local-nineteenth-final.log PY=.venv/bin/python OUT=/tmp bash <this script>
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  standard_rows new
  p2p_rows new 4K,64K,1M,16M
}

logged "${LOG:-nineteenth-final.log}" rows
