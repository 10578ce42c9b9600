#!/usr/bin/env bash
# Device, one call: cma writes into 4 KiB pages and into huge pages (bench p2p --hugepages,
# afabric.host_buffer), pattern fixed and span, alternated twice, with the wheel .whl-ab/new.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
install_wheels new

rows() {
  local r h p
  for r in 1 2; do
    for p in fixed span; do
      for h in "" --hugepages; do
        echo "--- cma $p ${h:-4k-pages} $(date +%T)"
        run new 100 -m afabric.cli bench p2p --provider cma --quick --sizes 64K,1M,16M --repeat 3 \
          --pattern $p $h | grep "^write"
      done
    done
  done
}

logged "${LOG:-hugepages.log}" rows
