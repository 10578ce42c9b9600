# Sourced by the tests/gpu/run_*.sh scripts (after they set OUT): the environment every GPU
# run needs and the time-limited step runner whose failures they summarise at the end.

# NVLink multicast stays off on the shared GPU hosts (afabric never asks for it; inherited
# by every process started below).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
# The checkout's afabric/ has no compiled libraries: never let the current directory
# (python -m puts it first on sys.path) shadow the installed wheel.
export PYTHONSAFEPATH=1
PY=${PYTHON:-python3}
SITE=${AFABRIC_SITE:-/tmp/afabric-site}
FAILS=()

step() { # step LOG NAME SECONDS CMD...: run CMD (time-limited), its output to $OUT/LOG and stdout
    local log=$OUT/$1 name=$2 limit=$3
    shift 3
    echo "== $name: $*" | tee -a "$log"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc$([ "$rc" -eq 124 ] && echo ' (timed out)')" | tee -a "$log"
    [ "$rc" -eq 0 ] || FAILS+=("$name (exit $rc)")
    return 0
}
