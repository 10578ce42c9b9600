#!/usr/bin/env bash
# Device, one call: a spare transfer made while the caller waits (new) against main
# (old), alternated twice (wheels.sh ab_rounds, awaited_rows): takesplit.py (the awaited
# write's C part), perop.py and latdist.py, shm / cma / tcp.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
ab_rounds spare-ab.log awaited_rows
