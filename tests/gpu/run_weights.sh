#!/usr/bin/env bash
# RL weight transfer on the 2x H200 machine (16 cores): `afabric bench weights` with 8
# trainer and 4 inference processes, point to point vs rank-0 on the same processes.
# Run from the repository root after building the wheel here (as for run_device.sh):
#
#     rm -rf .whl && pip wheel -q --no-deps -w .whl .     # here; carried with carry=[".whl"]
#     bash tests/gpu/run_weights.sh                        # there; logs go to $OUT
#
# Steps (each time-limited, 570 s in all at worst; the script goes on after a failure and exits
# non-zero if any failed):
#   1. --device cuda: trainers' FSDP shards on cuda:0/cuda:1 (round robin), sliced there and
#      staged through pinned host memory; shm carries the writes (the goal: P2P >= 3x rank-0);
#   2. the same model with --device cpu (DTensor shards, gloo full_tensor where needed);
#   3. --device cuda --provider tcp;
#   4. --device cuda --offload --fp8: DTensor shards in host memory (FSDP CPU offload), each
#      slice copied to the GPU and quantised to fp8 there.
# Files written to $OUT: weights-setup.log weights.log weights-cuda-shm.json
#   weights-cpu-shm.json weights-cuda-tcp.json weights-offload-fp8.json weights-summary.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"
source tests/gpu/common.sh  # the step runner and environment (cwd is the repo root)

if ! PYTHONPATH=$SITE "$PY" -c 'import afabric.weights' 2>/dev/null; then
    shopt -s nullglob
    wheels=(.whl/afabric-*.whl)
    if [ ${#wheels[@]} -ne 1 ]; then
        echo "need exactly one .whl/afabric-*.whl (build it with 'pip wheel --no-deps -w .whl .')" \
            | tee -a "$OUT/weights-setup.log"
        echo "FAILED: no wheel" >"$OUT/weights-summary.txt"
        exit 2
    fi
    rm -rf "$SITE"
    step weights-setup.log install 300 "$PY" -m pip install -q --no-deps --no-index --no-compile \
        --target "$SITE" "${wheels[0]}"
fi
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
{
    echo "date: $(date -Is)  cpus: $(nproc)  mem: $(free -g | awk '/Mem:/{print $2}') GiB"
    nvidia-smi -L 2>/dev/null
    "$PY" -c 'import torch; print("torch", torch.__version__, "gpus", torch.cuda.device_count())'
} 2>&1 | tee -a "$OUT/weights-setup.log"
if command -v afabric >/dev/null; then AFABRIC=(afabric); else AFABRIC=("$PY" -m afabric.cli); fi

step weights.log "bench weights (cuda, shm)" 180 "${AFABRIC[@]}" bench weights --trainers 8 --inference 4 \
    --device cuda --provider shm --json "$OUT/weights-cuda-shm.json"
step weights.log "bench weights (cpu, shm)" 150 "${AFABRIC[@]}" bench weights --trainers 8 --inference 4 \
    --device cpu --provider shm --repeat 3 --json "$OUT/weights-cpu-shm.json"
step weights.log "bench weights (cuda, tcp)" 120 "${AFABRIC[@]}" bench weights --trainers 8 --inference 4 \
    --device cuda --provider tcp --repeat 3 --json "$OUT/weights-cuda-tcp.json"
step weights.log "bench weights (cuda offload, fp8)" 120 "${AFABRIC[@]}" bench weights --trainers 8 \
    --inference 4 --device cuda --offload --fp8 --repeat 3 --json "$OUT/weights-offload-fp8.json"

{
    if [ ${#FAILS[@]} -eq 0 ]; then echo "all steps passed"; else echo "FAILED steps:"; printf '  %s\n' "${FAILS[@]}"; fi
} | tee "$OUT/weights-summary.txt"
[ ${#FAILS[@]} -eq 0 ]
