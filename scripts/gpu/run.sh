#!/usr/bin/env bash
# The GPU end-to-end check: builds the CUDA programs of scripts/gpu with nvcc,
# then runs the pytest harness in scripts/gpu/e2e (checks 1-43; see its
# conftest.py for the knobs), which writes table.md, results.json, e2e.log and
# e2e-logs.tar.gz to $OUT (default: the work dir) and prints the table last.
#
#   bash scripts/gpu/run.sh gpu-bundle [pytest args, e.g. -k "busy_share and 2000us" or --checks "1 4 7"]
#
# gpu-bundle holds libcuda_limiter.so, hypervisor, hypervisor-admission-latency
# (scripts/make-gpu-bundle.sh). E2E_BIN_DIR=dir: use programs already built
# there. Exit status: 0 when every check passed, 1 otherwise, 2 on a usage error.
set -o pipefail
BUNDLE=${1:-}
if [[ -z $BUNDLE ]]; then
  echo "usage: bash scripts/gpu/run.sh <bundle dir containing libcuda_limiter.so> [pytest args]" >&2
  exit 2
fi
shift
SRC=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
WORK=${E2E_WORK:-$(mktemp -d /tmp/gpu-e2e.XXXXXX)}
LOGS=$WORK/e2e-logs
BIN=${E2E_BIN_DIR:-$WORK/bin}
mkdir -p "$LOGS" "$BIN"
PY=${E2E_PYTEST_PYTHON:-python3}

build() {
  local nvcc cuda d cc
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc 2>/dev/null | head -n1)
  if [[ -z $nvcc ]]; then
    echo "build: nvcc not found (PATH or /usr/local/cuda/bin)" | tee "$LOGS/01-build.log"
    return
  fi
  cuda=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  local -a L=() R=() NV=("$nvcc" -O2 -arch=sm_90)
  for d in "$cuda/lib64" "$cuda/targets/x86_64-linux/lib" "$cuda/lib"; do
    [[ -d $d ]] || continue
    L+=(-L"$d") R+=(-Xlinker "-rpath=$d")
    [[ -d $d/stubs ]] && L+=(-L"$d/stubs")
  done
  cc=$(command -v gcc || command -v cc) || cc=""
  one() { # NAME CMD...: in the background, log in $LOGS/01-build-NAME.log
    local name=$1
    shift
    ({ echo "# $*"; "$@"; echo "# exit=$?"; } >"$LOGS/01-build-$name.log" 2>&1) &
  }
  one mem_runtime "${NV[@]}" -o "$BIN/mem_runtime" "$SRC/mem_runtime.cu"
  one mem_runtime_shared "${NV[@]}" -cudart shared "${L[@]}" "${R[@]}" -o "$BIN/mem_runtime_shared" "$SRC/mem_runtime.cu"
  one mem_apis "${NV[@]}" -o "$BIN/mem_apis" "$SRC/mem_apis.cu" "${L[@]}" -lcuda -ldl
  one mem_hold "${NV[@]}" -o "$BIN/mem_hold" "$SRC/mem_hold.cu"
  one mem_pairs "${NV[@]}" -Xcompiler -pthread -o "$BIN/mem_pairs" "$SRC/mem_pairs.cu"
  one mem_bench "${NV[@]}" -o "$BIN/mem_bench" "$SRC/mem_bench.cu" "${L[@]}" -lcuda
  one spin "${NV[@]}" -o "$BIN/spin" "$SRC/spin.cu"
  one launch_overhead "${NV[@]}" -o "$BIN/launch_overhead" "$SRC/launch_overhead.cu"
  # lazy_global.cu's 3 GiB __device__ global has a 3 GiB host shadow: the medium code model for the whole link
  one implicit_mem "${NV[@]}" -Xcompiler -mcmodel=medium -o "$BIN/implicit_mem" "$SRC/implicit_mem.cu" \
    "$SRC/lazy_global.cu" "${L[@]}" -lcuda
  one ipc_share "${NV[@]}" -o "$BIN/ipc_share" "$SRC/ipc_share.cu" "${L[@]}" -lcuda
  one big_global.cubin "${NV[@]}" -cubin -o "$BIN/big_global.cubin" "$SRC/big_global.cu"
  if [[ -n $cc ]]; then
    one spawn_bench "$cc" -O2 -o "$BIN/spawn_bench" "$SRC/spawn_bench.c"
  else
    one spawn_bench "$nvcc" -O2 -x c -o "$BIN/spawn_bench" "$SRC/spawn_bench.c"
  fi
  wait
  for f in "$LOGS"/01-build-*.log; do
    n=${f##*/01-build-}
    n=${n%.log}
    # a program is built when it is executable; a cubin (loaded by implicit_mem) when it is there
    if [[ -x $BIN/$n || ($n == *.cubin && -f $BIN/$n) ]]; then echo "build: $n ok"; else echo "build: $n FAILED:" && tail -n 15 "$f" | sed 's/^/    /'; fi
  done
}

if [[ -z ${E2E_BIN_DIR:-} ]]; then build; else echo "build: skipped, using binaries in $BIN"; fi
"$PY" -m pytest -p no:cacheprovider -q -rN --tb=short --bundle "$BUNDLE" --bin-dir "$BIN" --work "$WORK" \
  "$SRC/e2e" "$@" 2>&1 | tee "$LOGS/02-pytest.log"
rc=$?
[[ -f ${OUT:-$WORK}/table.md ]] || { echo "no table: the harness did not start (see $LOGS/02-pytest.log)"; exit 2; }
exit "$rc"
