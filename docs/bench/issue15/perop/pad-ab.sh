#!/usr/bin/env bash
# Device, one call: an experiment build (not landed) with the engine's hot fields on cache
# lines of their own (new) against main (old), alternated twice (wheels.sh ab_rounds,
# awaited_rows): takesplit.py (the awaited write's C part), perop.py and latdist.py, shm /
# cma / tcp.
set -uo pipefail
. docs/bench/issue15/perop/wheels.sh
ab_rounds pad-ab.log awaited_rows
