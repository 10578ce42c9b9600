#!/usr/bin/env bash
# The GPU checks, on the lent GPU machine (Ubuntu 24.04; python3 with torch, CuPy, uvloop
# and pytest already there; libfabric1 installed but no headers, so nothing can be
# compiled there; no network). Run from anywhere, after building the wheel here:
#
#     pip wheel --no-deps -w .whl .          # carried to the machine in .whl/
#     bash tests/gpu/run_device.sh           # there; logs go to $OUT (default ./device-out)
#
# It installs the wheel (no dependencies, no index) into its own folder, then runs
# tests/gpu with pytest (one pytest per file, so a crash in one does not hide the others),
# `afabric bench trigger --quick` (shm; also shm with spinning workers, and tcp) and
# `afabric bench p2p --provider shm --quick`. Each step's output is kept; the script goes
# on after a failed step and exits non-zero at the end if any failed.
#
# What comes back from $OUT there is at most 8 files: this writes exactly these:
#   setup.log  pytest-gpu.log  bench.log  trigger-shm.json  trigger-shm-spin.json
#   trigger-tcp.json  p2p-shm.json  summary.txt
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/device-out}
mkdir -p "$OUT"

source tests/gpu/common.sh  # the step runner and environment (cwd is the repo root)
# On the GPU machine a GPU test that would skip (no CuPy, no CUDA) fails instead.
export AFABRIC_REQUIRE_GPU=${AFABRIC_REQUIRE_GPU:-1}

# ---- the machine, and the install ----
{
    echo "date: $(date -Is)  host: $(hostname)  kernel: $(uname -r)  cpus: $(nproc)"
    command -v nvidia-smi >/dev/null && nvidia-smi -L
    "$PY" - <<'EOF'
import sys
print("python", sys.version.split()[0], sys.executable)
for name in ("numpy", "torch", "cupy", "uvloop", "pytest", "pytest_asyncio", "pytest_timeout"):
    try:
        mod = __import__(name)
        print(f"  {name} {getattr(mod, '__version__', '?')}")
    except Exception as e:  # noqa: BLE001
        print(f"  {name}: not importable ({type(e).__name__}: {e})")
try:
    import torch
    print("  torch.cuda.is_available():", torch.cuda.is_available(), "devices:", torch.cuda.device_count())
except Exception as e:  # noqa: BLE001
    print("  torch CUDA check failed:", e)
EOF
    echo "libfabric: $(ldconfig -p 2>/dev/null | grep -E 'libfabric\.so\.1 ' | head -1 || true)"
    ls /dev/shm >/dev/null 2>&1 && echo "/dev/shm: present" || echo "/dev/shm: MISSING (the shm provider needs it)"
} 2>&1 | tee -a "$OUT/setup.log"

shopt -s nullglob
wheels=(.whl/afabric-*.whl)
if [ ${#wheels[@]} -ne 1 ]; then
    echo "need exactly one .whl/afabric-*.whl (found ${#wheels[@]}): build it with 'pip wheel --no-deps -w .whl .'" \
        | tee -a "$OUT/setup.log"
    echo "FAILED: no wheel" >"$OUT/summary.txt"
    exit 2
fi
extra=(.whl/pytest_asyncio-*.whl)  # optional: lets tests/conftest.py load (see below)
rm -rf "$SITE"
step setup.log install 300 "$PY" -m pip install -q --no-deps --no-index --no-compile --target "$SITE" \
    "${wheels[0]}" "${extra[@]}"
export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
export PATH=$SITE/bin:$PATH
step setup.log import 60 "$PY" -c '
import afabric, afabric_ofi, sys
site = sys.argv[1]
print("afabric from", afabric.__file__, "| afabric_ofi from", afabric_ofi.__file__)
assert afabric.__file__.startswith(site) and afabric_ofi.__file__.startswith(site), "not the wheel"
' "$SITE"
if command -v afabric >/dev/null; then AFABRIC=(afabric); else AFABRIC=("$PY" -m afabric.cli); fi
step setup.log "afabric info" 120 "${AFABRIC[@]}" info

# ---- tests/gpu ----
# tests/conftest.py implements a pytest-asyncio hook; without that plugin pytest refuses
# the conftest ("unknown hook"), so it is left out then (tests/gpu needs no plugin).
# importlib mode: pytest must not put the checkout on sys.path either.
conf=()
"$PY" -c 'import pytest_asyncio' 2>/dev/null || conf=(--noconftest)
for f in tests/gpu/test_*.py; do
    step pytest-gpu.log "pytest $(basename "$f")" 300 "$PY" -m pytest -q -rA -p no:cacheprovider \
        --import-mode=importlib "${conf[@]}" "$f"
done

# ---- benchmarks ----
step bench.log "bench trigger (shm)" 240 "${AFABRIC[@]}" bench trigger --quick --provider shm --json "$OUT/trigger-shm.json"
step bench.log "bench trigger (shm, spin)" 240 "${AFABRIC[@]}" bench trigger --quick --provider shm --polling spin \
    --json "$OUT/trigger-shm-spin.json"
step bench.log "bench trigger (tcp)" 240 "${AFABRIC[@]}" bench trigger --quick --provider tcp \
    --json "$OUT/trigger-tcp.json"
step bench.log "bench p2p (shm)" 400 "${AFABRIC[@]}" bench p2p --provider shm --quick --json "$OUT/p2p-shm.json"

# ---- summary ----
{
    if [ ${#FAILS[@]} -eq 0 ]; then
        echo "all steps passed"
    else
        echo "FAILED steps:"
        printf '  %s\n' "${FAILS[@]}"
    fi
} | tee "$OUT/summary.txt"
[ ${#FAILS[@]} -eq 0 ]
