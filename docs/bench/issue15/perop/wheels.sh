# Sourced by the device scripts here: install_wheels NAME... puts each wheel of .whl-ab/NAME
# (built on the development machine) into /tmp/site-NAME, for PYTHONPATH=/tmp/site-NAME
# python -P; and makes the carried fabtests (.fabtests) executable where they came along.
# run NAME SECONDS ARGS...: python -P ARGS with the wheel NAME, under a time limit.
# standard_rows NAME (below): the rows every call ends with.
# Run from the repository root. OUT: where logs go ($OUT on the device; /tmp here); PY: the
# Python (.venv/bin/python here); ROOT: the repository root.
ROOT=${ROOT:-$PWD}
OUT=${OUT:-/tmp}
PY=${PY:-python3}

install_wheels() {
  local w
  for w in "$@"; do
    rm -rf "/tmp/site-$w"
    "${PY:-python3}" -m pip install -q --no-deps --no-index --no-compile --target "/tmp/site-$w" \
      .whl-ab/"$w"/afabric-*.whl 2>&1 | grep -v "Running pip"
  done
  if [ -d .fabtests ]; then chmod +x .fabtests/*; fi
}

run() { local w=$1 t=$2; shift 2; PYTHONPATH=/tmp/site-$w timeout "$t" "${PY:-python3}" -P "$@"; }

# p2p_rows NAME SIZES: bench p2p against fi_rma_bw (shm, tcp; .fabtests) at SIZES with the
# wheel NAME, its table.
p2p_rows() {
  local w=$1 sizes=$2 p
  for p in shm tcp; do
    echo "=== p2p $p $w $(date +%T)"
    run "$w" 200 -m afabric.cli bench p2p --quick --sizes "$sizes" --repeat 3 \
      --fabtests "$ROOT/.fabtests" --provider $p | sed -n '/^op /,/^awaited/p'
  done
}

# The usual rows of the wheel NAME:
# bench p2p against fi_rma_bw (shm, tcp; .fabtests), cma, bench trigger (shm, tcp), and
# idle engines (shm, tcp, cma).
standard_rows() {
  local w=$1 p
  p2p_rows "$w" 4K,64K,1M,16M
  echo "=== p2p cma $w $(date +%T)"
  run "$w" 120 -m afabric.cli bench p2p --quick --sizes 4K,64K,1M,16M --repeat 3 --pattern fixed \
    --provider cma | sed -n '/^op /,/^awaited/p'
  for p in shm tcp; do
    echo "--- trigger $p $(date +%T)"
    run "$w" 120 -m afabric.cli bench trigger --quick --provider $p | grep -E "^triggered|^python "
  done
  for p in shm tcp cma; do echo "--- $w"; run "$w" 30 docs/bench/issue15/idle.py $p; done
}

# awaited_rows NAME: one awaited write taken apart (takesplit.py: its second round), 64 lanes'
# cost per write (perop.py) and the awaited write's distribution (latdist.py: two of three
# runs), shm, cma and tcp, with the wheel NAME.
awaited_rows() {
  local w=$1 p
  for p in shm cma tcp; do
    run "$w" 60 docs/bench/issue15/perop/takesplit.py $p | grep -E "take|raw|await" | tail -4 | sed "s/^/$p /"
    run "$w" 60 docs/bench/issue15/perop/perop.py $p
    run "$w" 60 docs/bench/issue15/perop/latdist.py $p | tail -2
  done
}

# fi_pairs: fabtests' pair.sh fi_rma_bw from .fabtests (shm, tcp;ofi_rxm; 64 KiB at window
# 64, 1 MiB at window 16, each also with -U, delivery complete): the C reference's rows.
fi_pairs() {
  local p s u
  for p in shm "tcp;ofi_rxm"; do
    for s in "65536 -W 64" "1048576 -W 16"; do
      for u in "" "-U"; do
        echo "--- pair.sh fi_rma_bw $p $s $u $(date +%T)"
        # shellcheck disable=SC2086 # size and window are two words on purpose
        bash .fabtests/pair.sh fi_rma_bw "$p" $s $u
      done
    done
  done
}

# trigger_rows NAME: `bench trigger` (2000 iterations) shm and tcp, twice, with the wheel NAME.
trigger_rows() {
  local w=$1 r p
  for r in 1 2; do
    for p in shm tcp; do
      echo "--- bench trigger $p $(date +%T)"
      run "$w" 120 -m afabric.cli bench trigger --provider $p | grep -E "^triggered|^python "
    done
  done
}

# logged LOG CMD...: CMD between start and end lines, into $OUT/LOG and on stdout, without
# the progress lines (the device scripts' frame).
logged() {
  local log=$1
  shift
  {
    echo "=== start $(date +%T) $(nproc) CPUs"
    "$@"
    echo "=== end $(date +%T)"
  } 2>&1 | grep --line-buffered -v "^afabric: [0-9]*/" | tee "$OUT/$log"
}

# ab_rounds LOG FN: FN old, FN new, twice, between start and end lines, into $OUT/LOG (the
# A/B scripts here; FN gets the wheel name). Installs both wheels first.
ab_rounds() {
  local log=$1 fn=$2
  install_wheels old new
  logged "$log" _ab_body "$fn"
}

_ab_body() {
  local r w
  for r in 1 2; do
    for w in old new; do
      echo "--- $w $(date +%T)"
      "$1" "$w"
    done
  done
}
