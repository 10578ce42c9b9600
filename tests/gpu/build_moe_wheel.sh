#!/usr/bin/env bash
# Builds the wheel that tests/gpu/run_moe.sh installs on the GPU machine, into .whl-moe/,
# from the committed tree plus this checkout's afabric/moe, afabric/bench/moe.py and
# afabric/cli.py (so other work in progress in the checkout stays out of it).
set -euo pipefail
cd "$(dirname "$0")/../.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git archive HEAD | tar -x -C "$tmp"
mkdir -p "$tmp/afabric/moe"
cp afabric/moe/*.py afabric/moe/*.cu "$tmp/afabric/moe/"
cp afabric/bench/moe.py "$tmp/afabric/bench/moe.py"
grep -q '"afabric.bench.moe"' "$tmp/afabric/cli.py" || cp afabric/cli.py "$tmp/afabric/cli.py"
rm -rf .whl-moe
pip wheel -q --no-deps --no-build-isolation -w .whl-moe "$tmp"
ls -la .whl-moe
