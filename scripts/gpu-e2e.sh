#!/usr/bin/env bash
# GPU end-to-end check of the per-pod memory quota (checks 1-10) and compute
# share (checks 11-15) enforced by libcuda_limiter.so, and of the node
# hypervisor that drives it (checks 16-20).
#
# Usage, from the repo root on the GPU machine (one H100, CUDA 13, nvcc, python3 + torch):
#   bash scripts/gpu-e2e.sh gpu-bundle          # gpu-bundle/ holds libcuda_limiter.so
#                                               # (and hypervisor, hypervisor-latency-test)
#
# Every check runs the same program WITHOUT and WITH the limiter, in the same
# script run, and records both in a Markdown table; a step that fails is
# recorded as FAIL and the script goes on. Memory checks (1-10) use LD_PRELOAD +
# CUDA_DEVICE_MEMORY_LIMIT=4g; compute checks (11-15) use LD_PRELOAD +
# CUDA_DEVICE_SM_LIMIT=L (HAMi's name; E2E_SM_VAR=CUDA_LIMITER_SM_LIMIT for ours)
# with a distinct CUDA_LIMITER_POD per check, /dev/shm/gpushare-{pod,limits}-e2e-*
# removed between runs:
#   11  busy share of spin (SMs-filling kernel busy-waiting on %globaltimer) at
#       L = 10/25/50/75 x kernel 50us/2ms x runtime/graph launches, 3 s each:
#       |share from 1 s to the end - L| <= 3 pp and settle time <= 1 s
#   12  per-second busy series of the L=25, 2 ms, runtime run (from check 11)
#   13  PyTorch bf16 matmul loop at L=25/50: GPU time share (nvidia-smi utilization) = L +- 3 pp; throughput ratio reported
#   14  launch cost, medians of 5 alternated runs: 200k empty kernels with the
#       preload and no limit (added <= 1%); 20 us host work + 1 launch, x20000,
#       at L=50 (added <= 3%)
#   15  two spin processes at once at L=50: one pod -> union 50 +- 3 %; two pods
#       -> union >= 90 %
# The new checks take about 2.5 minutes when the limiter works.
# Checks 16-20 run the node daemon, gpu-bundle/hypervisor (E2E_HYPERVISOR=path
# overrides), on 127.0.0.1 and a port the kernel picks, with a config written
# to $WORK/hv-<check>.toml; the spin processes run with CUDA_LIMITER_HYPERVISOR,
# CUDA_LIMITER_POD and CUDA_LIMITER_TOKEN (no local limit). Shares are each
# process's own busy time (union of its kernel intervals), from
# scripts/gpu/hv_intervals.py; t = seconds after the processes were released:
#   16  pods A, B weights 1:3, policy fixed, no cap, 4 s at once: A = 25 +- 3,
#       B = 75 +- 3 pp (from 1 s, common span; spin union)
#   17a pod A cap 30, policy fixed, alone: 30 +- 3 pp
#   17b pod A share 30, policy elastic, alone 2 s (>= 90% over [0.5, 2] s), then
#       pod B (weight 1, fixed) for 3 s: A over [B start + 1 s, B end] = max(30,
#       weighted fair 50) = 50 +- 3 pp; 100 ms series and return time printed
#   18  pod A cap 50, suspended at t=1.5 s and resumed at t=3.5 s through the
#       admin API: busy in [1.7, 3.4] s <= 3%, from 3.7 s 50 +- 3 pp, exit 0,
#       kernels = launches
#   19  pods A, B weights 1:1, kill -9 of the daemon at t=2 s, started again at
#       t=4 s on the same port: both exit 0, busy in [2.2, 3.8] s = last granted
#       share +- 5 pp, workers of both pods listed again by t=5.5 s
#   20  gpu-bundle/hypervisor-latency-test (the crate's tests/latency.rs), when
#       present: client-side p50 <= 200 us, p99 <= 2 ms
# Checks 16-20 take about 1 minute.
# Checks 21-22 (issue 9: fail closed, reports right at once), about 1 minute:
#   21  a process of pod P holds 3 GiB, then exits without freeing (a) or is
#       killed with SIGKILL (b); at once (no sleep) the next process of P
#       reports cudaMemGetInfo and nvidia-smi: with the limiter total=4096MiB,
#       free >= 3072MiB, nvidia-smi used <= 512MiB; without, free is back
#       within 1 GiB of what the holder saw before allocating
#   22  CUDA_LIMITER_HYPERVISOR names a port nothing listens on (grant timeout
#       2 s): (a) with CUDA_DEVICE_MEMORY_LIMIT=4g, cudaMalloc until OOM as in
#       check 1, and one stderr line saying the local limits apply; (b) with no
#       local limit, CUDA refuses to initialise (cudaMalloc fails, exit 0 of
#       mem_hold) with exactly one "cuda-limiter:" line
#
# Outputs:
#   stdout                       progress lines, then the table (printed last)
#   ${OUT:-$WORK}/e2e.log        everything: progress, every step's log, the table
#   ${OUT:-$WORK}/table.md       the table and the "N passed, M failed" line
#   ${OUT:-$WORK}/e2e-logs.tar.gz  the per-step logs ($WORK/e2e-logs/<step>.log)
# The per-step logs live in $WORK/e2e-logs (not under $OUT, which returns at most
# 8 files); e2e.log holds them all anyway.
#
# Knobs (environment):
#   E2E_ONLY="1 4 7"     run only these checks (numbers as in the table)
#   E2E_BIN_DIR=dir      use binaries already built there instead of building
#   CUDA_LIMITER_LOG     limiter log level for the limited runs (default info)
#   PYTHON               python with torch (default python3)
#   E2E_SM_VAR           compute-limit variable (default CUDA_DEVICE_SM_LIMIT)
#   E2E_SHARE_SECS       seconds per spin run in checks 11, 12, 15 (default 3)
#   E2E_TORCH_SECS       timed seconds per matmul run in check 13 (default 6,
#                        after 2 s of warm-up)
#   E2E_HYPERVISOR       the hypervisor binary (default <bundle>/hypervisor)
#   E2E_HV_LOG           the daemon's log level, HYPERVISOR_LOG (default info)
#   E2E_HV_B_WEIGHT      pod B's weight in check 17b (default 1; 3 makes A's
#                        guaranteed 30% the binding term)
#   E2E_HV_SIMULATE=1    the daemon simulates the GPU (--simulate-gpus 1): a dry
#                        run of checks 16-20's plumbing on a machine without one
#
# Exit status: 0 when every check passed, 1 otherwise, 2 on a usage error.

set -o pipefail

BUNDLE=${1:-}
if [[ -z $BUNDLE ]]; then
  echo "usage: bash scripts/gpu-e2e.sh <bundle-dir containing libcuda_limiter.so>" >&2
  exit 2
fi
if [[ -d $BUNDLE ]]; then
  LIB="$(cd "$BUNDLE" && pwd)/libcuda_limiter.so"
else
  LIB="$BUNDLE/libcuda_limiter.so"
fi

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SRC=$HERE/gpu
WORK=$(mktemp -d /tmp/gpu-e2e.XXXXXX)
RES=${OUT:-$WORK}
LOG_DIR=$WORK/e2e-logs
mkdir -p "$LOG_DIR" "$RES"
PROGRESS=$WORK/progress.log
: >"$PROGRESS"
BIN=${E2E_BIN_DIR:-$WORK/bin}
mkdir -p "$BIN"
PY=${PYTHON:-python3}
LIMITER_LOG=${CUDA_LIMITER_LOG:-info}
ONLY=${E2E_ONLY:-}
SM_VAR=${E2E_SM_VAR:-CUDA_DEVICE_SM_LIMIT}
SHARE_SECS=${E2E_SHARE_SECS:-3}
[[ $SHARE_SECS =~ ^[1-9][0-9]*$ ]] || SHARE_SECS=3
TORCH_SECS=${E2E_TORCH_SECS:-6}
[[ $TORCH_SECS =~ ^[1-9][0-9]*$ ]] || TORCH_SECS=6

MiB=1048576
GiB=1073741824
QUOTA=4294967296 # 4 GiB, the quota used everywhere
QUOTA_MIB=4096
SLACK=$((2 * MiB))

PASSED=0
FAILED=0
ROWS=()
BG_PIDS=()
T_START=$(date +%s)

# ----------------------------------------------------------------- helpers --

say() { printf '%s\n' "$*"; printf '%s\n' "$*" >>"$PROGRESS"; }

# kv FILE KEY: value of the first "KEY=value" line in FILE (whitespace removed)
kv() {
  local v
  v=$(grep -a -m1 -E "^$2=" "$1" 2>/dev/null | cut -d= -f2-)
  v=${v//[[:space:]]/}
  printf '%s' "$v"
}

isnum() { [[ ${1:-} =~ ^-?[0-9]+$ ]]; }

# ncmp A OP B: integer comparison that is false when either side is not a number
ncmp() {
  isnum "$1" && isnum "$3" || return 1
  case $2 in
    eq) (($1 == $3)) ;;
    ne) (($1 != $3)) ;;
    lt) (($1 < $3)) ;;
    le) (($1 <= $3)) ;;
    gt) (($1 > $3)) ;;
    ge) (($1 >= $3)) ;;
    *) return 1 ;;
  esac
}

# exitof LOG: the exit status run_prog wrote into LOG ("?" when none)
exitof() {
  local v
  v=$(grep -a -m1 -E '^# exit=' "$1" 2>/dev/null | sed -E 's/^# exit=([0-9]+).*/\1/')
  printf '%s' "${v:-?}"
}

# exit_why LOG TAG: " TAG-exit=N" when the run in LOG did not exit 0
exit_why() {
  local e
  e=$(exitof "$1")
  [[ $e == 0 ]] || printf ' %s-exit=%s' "$2" "$e"
}

# isfloat X: X is a decimal number
isfloat() { [[ ${1:-} =~ ^-?[0-9]+(\.[0-9]+)?$ ]]; }

# fok EXPR A [B [C]]: every argument is a number and the awk expression EXPR
# over a, b, c holds (false otherwise)
fok() {
  local e=$1 x
  shift
  for x in "$@"; do isfloat "$x" || return 1; done
  awk -v a="${1:-0}" -v b="${2:-0}" -v c="${3:-0}" "BEGIN{ exit !($e) }"
}

# fcalc FMT EXPR A [B [C]]: printf FMT of EXPR over a, b, c; "?" when any argument is not a number
fcalc() {
  local f=$1 e=$2 x
  shift 2
  for x in "$@"; do isfloat "$x" || { printf '?'; return; }; done
  awk -v a="${1:-0}" -v b="${2:-0}" -v c="${3:-0}" "BEGIN{ printf \"$f\", ($e) }"
}

# |A| <= B
within() { isnum "$1" && isnum "$2" && (((${1#-}) <= $2)); }

gib() { awk -v b="${1:-x}" 'BEGIN{ if (b ~ /^-?[0-9]+$/) printf "%.2fGiB", b/1073741824; else printf "?" }'; }
mibs() { awk -v b="${1:-x}" 'BEGIN{ if (b ~ /^-?[0-9]+$/) printf "%dMiB", b/1048576; else printf "?" }'; }

# median of the numbers given as arguments (floats allowed); empty when none
median() {
  printf '%s\n' "$@" | grep -E '^-?[0-9]+(\.[0-9]+)?$' | sort -g |
    awk '{a[NR]=$1} END{ if (NR==0) exit; if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2 }'
}

want() { [[ -z $ONLY ]] || [[ " $ONLY " == *" $1 "* ]]; }

built() { [[ -x $BIN/$1 ]]; }

# every pod of this script is named e2e-*: other users' regions are left alone
clean_shm() { rm -f /dev/shm/gpushare-pod-e2e-* /dev/shm/gpushare-limits-e2e-* 2>/dev/null; }

# row CHECK WITHOUT WITH EXPECTED REASONS   (empty REASONS = PASS)
row() {
  local result
  if [[ $5 == INFO ]]; then
    result=INFO
  elif [[ -z $5 ]]; then
    result=PASS
    PASSED=$((PASSED + 1))
  else
    result="FAIL:$5"
    FAILED=$((FAILED + 1))
  fi
  local a=${2//|//} b=${3//|//} c=${4//|//} d=${result//|//}
  ROWS+=("| $1 | ${a:-(none)} | ${b:-(none)} | ${c:-(none)} | $d |")
  say "[${result%%:*}] $1 | without: ${a:-(none)} | with: ${b:-(none)} | expected: $c${5:+ | why:$5}"
}

# env_for MODE POD: sets ENVCMD, the env(1) prefix for a run
#   base   without the limiter
#   lim    with the limiter and the 4 GiB memory quota, pod POD
#   pre    with the limiter loaded and active (a 60 GiB memory quota) but no
#          compute limit
#   sm:L   with the limiter and a compute limit of L percent, pod POD
#   hv     with the limiter in hypervisor mode (HV_URL), pod POD and its token
#   down:M with the limiter in hypervisor mode at HV_DOWN_URL (nothing
#          listens), grant timeout 2 s, pod POD; local memory limit M (none
#          when M is empty)
env_for() {
  ENVCMD=(env -u LD_PRELOAD -u CUDA_DEVICE_MEMORY_LIMIT -u CUDA_LIMITER_MEMORY_LIMIT -u CUDA_LIMITER_POD
    -u CUDA_DEVICE_SM_LIMIT -u CUDA_LIMITER_SM_LIMIT -u CUDA_LIMITER_GRANT_TIMEOUT_MS
    -u CUDA_LIMITER_HYPERVISOR -u CUDA_LIMITER_TOKEN -u CUDA_LIMITER_TOKEN_FILE)
  case $1 in
    lim) ENVCMD+=(LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_LIMIT=4g CUDA_LIMITER_POD="$2" CUDA_LIMITER_LOG="$LIMITER_LOG") ;;
    pre) ENVCMD+=(LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_LIMIT=60g CUDA_LIMITER_POD=e2e-pre CUDA_LIMITER_LOG="$LIMITER_LOG") ;;
    sm:*) ENVCMD+=(LD_PRELOAD="$LIB" "$SM_VAR=${1#sm:}" CUDA_LIMITER_POD="$2" CUDA_LIMITER_LOG="$LIMITER_LOG") ;;
    hv) ENVCMD+=(LD_PRELOAD="$LIB" CUDA_LIMITER_POD="$2" CUDA_LIMITER_HYPERVISOR="$HV_URL"
      CUDA_LIMITER_TOKEN="$(hv_token "$2")" CUDA_LIMITER_LOG="$LIMITER_LOG") ;;
    down:*) ENVCMD+=(LD_PRELOAD="$LIB" CUDA_LIMITER_POD="$2" CUDA_LIMITER_HYPERVISOR="$HV_DOWN_URL"
      CUDA_LIMITER_TOKEN=e2e-down CUDA_LIMITER_GRANT_TIMEOUT_MS=2000 CUDA_LIMITER_LOG="$LIMITER_LOG")
      [[ -n ${1#down:} ]] && ENVCMD+=(CUDA_DEVICE_MEMORY_LIMIT="${1#down:}") ;;
  esac
}

# run_prog MODE POD LOG TIMEOUT_S CMD...: run CMD with or without the limiter,
# stdout+stderr into LOG (with a header and the exit status); returns the exit status.
run_prog() {
  local mode=$1 pod=$2 log=$3 t=$4
  shift 4
  env_for "$mode" "$pod"
  {
    echo "# mode=$mode pod=$pod timeout=${t}s"
    echo "# cmd: ${ENVCMD[*]} $*"
    echo "# start $(date +%T.%N)"
  } >"$log"
  # in a subshell, so that bash's "Segmentation fault" notice lands in the log too
  (timeout -k 5 "$t" "${ENVCMD[@]}" "$@") >>"$log" 2>&1
  local rc=$?
  local note=""
  ((rc == 124 || rc == 137)) && note=" (TIMEOUT after ${t}s)"
  ((rc > 128 && rc != 137)) && note=" (killed by signal $((rc - 128)))"
  echo "# exit=$rc end $(date +%T.%N)$note" >>"$log"
  return $rc
}

cleanup() {
  local p c
  # the direct children first (the timeout(1) of a background run_prog, which
  # passes SIGTERM on to its program), by their pids
  for p in "${BG_PIDS[@]}"; do
    for c in $(ps -o pid= --ppid "$p" 2>/dev/null); do kill -TERM "$c" 2>/dev/null; done
  done
  for p in "${BG_PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
  touch "$WORK"/release-* "$WORK"/go-* 2>/dev/null
  clean_shm
}
trap cleanup EXIT
# a signal ends the script through exit, so that the EXIT trap runs
trap 'exit 130' INT
trap 'exit 143' TERM

# --------------------------------------------------------------- preflight --

preflight() {
  local log=$LOG_DIR/00-preflight.log
  {
    echo "date: $(date)"
    echo "host: $(uname -a)"
    echo "repo: $(git -C "$HERE/.." rev-parse HEAD 2>/dev/null)"
    echo "limiter: $LIB"
    ls -la "$LIB" 2>&1
    sha256sum "$LIB" 2>&1
    file "$LIB" 2>&1
    echo "--- nvidia-smi"
    nvidia-smi 2>&1
    echo "--- compute apps before the checks"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv 2>&1
    echo "--- nvcc"
    "${NVCC:-nvcc}" --version 2>&1
    echo "--- python/torch"
    "$PY" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
    echo "--- /dev/shm before"
    ls -la /dev/shm 2>&1
  } >"$log" 2>&1
  say "limiter: $LIB"
  say "work dir: $WORK   results: $RES"
  if [[ ! -f $LIB ]]; then
    say "ERROR: $LIB does not exist; every limited run will fail"
    row "0. limiter library present" "-" "missing" "file exists" "no $LIB"
  fi
  local apps
  apps=$(env -u LD_PRELOAD nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | grep -c '[0-9]')
  if ((${apps:-0} > 0)); then
    say "WARNING: $apps other process(es) already use the GPU; baseline numbers may be off"
  fi
}

# ------------------------------------------------------------------- build --

find_nvcc() {
  local p
  p=$(command -v nvcc 2>/dev/null) && { echo "$p"; return; }
  for p in /usr/local/cuda/bin/nvcc /usr/local/cuda-13*/bin/nvcc; do
    [[ -x $p ]] && { echo "$p"; return; }
  done
}

build_all() {
  if [[ -n ${E2E_BIN_DIR:-} ]]; then
    say "build: skipped, using binaries in $BIN"
    return
  fi
  if [[ -z $NVCC ]]; then
    say "build: nvcc not found (PATH or /usr/local/cuda/bin)"
    return
  fi
  local cuda_home d
  cuda_home=$(dirname "$(dirname "$(readlink -f "$NVCC")")")
  local -a libdirs=() rpath=()
  for d in "$cuda_home/lib64" "$cuda_home/targets/x86_64-linux/lib" "$cuda_home/lib"; do
    [[ -d $d ]] || continue
    libdirs+=(-L"$d")
    rpath+=(-Xlinker "-rpath=$d")
    [[ -d $d/stubs ]] && libdirs+=(-L"$d/stubs")
  done
  local -a NV=("$NVCC" -O2 -arch=sm_90)
  local cc
  cc=$(command -v gcc || command -v cc)
  say "build: nvcc=$NVCC cc=${cc:-none} -> $BIN"

  local -A pids=()
  build_bg() { # build_bg NAME CMD...
    local name=$1
    shift
    (
      echo "# $*"
      "$@"
      echo "# exit=$?"
    ) >"$LOG_DIR/01-build-$name.log" 2>&1 &
    pids[$name]=$!
  }
  build_bg mem_runtime "${NV[@]}" -o "$BIN/mem_runtime" "$SRC/mem_runtime.cu"
  build_bg mem_runtime_shared "${NV[@]}" -cudart shared "${libdirs[@]}" "${rpath[@]}" -o "$BIN/mem_runtime_shared" "$SRC/mem_runtime.cu"
  build_bg mem_apis "${NV[@]}" -o "$BIN/mem_apis" "$SRC/mem_apis.cu" "${libdirs[@]}" -lcuda -ldl
  build_bg mem_hold "${NV[@]}" -o "$BIN/mem_hold" "$SRC/mem_hold.cu"
  build_bg mem_pairs "${NV[@]}" -Xcompiler -pthread -o "$BIN/mem_pairs" "$SRC/mem_pairs.cu"
  build_bg mem_bench "${NV[@]}" -o "$BIN/mem_bench" "$SRC/mem_bench.cu" "${libdirs[@]}" -lcuda
  build_bg spin "${NV[@]}" -o "$BIN/spin" "$SRC/spin.cu"
  build_bg launch_overhead "${NV[@]}" -o "$BIN/launch_overhead" "$SRC/launch_overhead.cu"
  if [[ -n $cc ]]; then
    build_bg spawn_bench "$cc" -O2 -o "$BIN/spawn_bench" "$SRC/spawn_bench.c"
  else
    build_bg spawn_bench "$NVCC" -O2 -x c -o "$BIN/spawn_bench" "$SRC/spawn_bench.c"
  fi
  local n
  for n in "${!pids[@]}"; do wait "${pids[$n]}"; done
  for n in mem_runtime mem_runtime_shared mem_apis mem_hold mem_pairs mem_bench spawn_bench spin launch_overhead; do
    if built "$n"; then
      say "build: $n ok"
    else
      say "build: $n FAILED (see $LOG_DIR/01-build-$n.log):"
      tail -n 15 "$LOG_DIR/01-build-$n.log" | sed 's/^/    /' | tee -a "$PROGRESS"
    fi
  done
}

# ---------------------------------------------------------------- checks --

# 1 / 2: runtime API, static or shared cudart
check_runtime() { # NUM LABEL BIN POD
  local num=$1 label=$2 bin=$3 pod=$4
  local name="$num. cudaMalloc until OOM ($label)"
  local exp="with: total=4096MiB, 2GiB<=got<=4GiB, err=2, free<256MiB, footprint<=4096MiB; without: total>16GiB, got>8GiB"
  if ! built "$bin"; then
    row "$name" "not built" "not built" "$exp" "build failed"
    return
  fi
  local b=$LOG_DIR/$num-$bin-base.log l=$LOG_DIR/$num-$bin-lim.log
  clean_shm
  run_prog base - "$b" 180 "$BIN/$bin"
  clean_shm
  run_prog lim "$pod" "$l" 180 "$BIN/$bin"
  local bt bo bf bfp bd lt lo lf lfp lfr ld
  bt=$(kv "$b" total0) bo=$(kv "$b" obtained) bf=$(kv "$b" fail_code) bfp=$(kv "$b" footprint_mib) bd=$(kv "$b" done)
  lt=$(kv "$l" total0) lo=$(kv "$l" obtained) lf=$(kv "$l" fail_code) lfp=$(kv "$l" footprint_mib) ld=$(kv "$l" done)
  lfr=$(kv "$l" free1)
  local why
  why="$(exit_why "$b" base)$(exit_why "$l" lim)"
  [[ $bd == 1 ]] || why+=" base-did-not-finish"
  ncmp "$bt" gt $((16 * GiB)) || why+=" base-total<=16GiB"
  ncmp "$bo" gt $((8 * GiB)) || why+=" base-got<=8GiB"
  [[ $ld == 1 ]] || why+=" lim-did-not-finish"
  ncmp "$lt" eq $QUOTA || why+=" total!=quota"
  ncmp "$lo" le $QUOTA || why+=" got>quota"
  ncmp "$lo" ge $((2 * GiB)) || why+=" got<2GiB"
  ncmp "$lf" eq 2 || why+=" err!=2"
  ncmp "$lfr" lt $((256 * MiB)) || why+=" free-after>=256MiB"
  { ncmp "$lfp" ge 0 && ncmp "$lfp" le $QUOTA_MIB; } || why+=" footprint"
  row "$name" \
    "total=$(mibs "$bt") got=$(gib "$bo") err=${bf:-?} fp=${bfp:-?}MiB" \
    "total=$(mibs "$lt") got=$(gib "$lo") err=${lf:-?} free=$(mibs "$lfr") fp=${lfp:-?}MiB" \
    "$exp" "$why"
}

# 3: driver API through ctypes (plain dlopen and RTLD_DEEPBIND)
check_ctypes() {
  local mode
  for mode in default deepbind; do
    local b=$LOG_DIR/3-ctypes-$mode-base.log l=$LOG_DIR/3-ctypes-$mode-lim.log
    clean_shm
    run_prog base - "$b" 120 "$PY" "$SRC/mem_ctypes.py" "$mode"
    clean_shm
    run_prog lim "e2e-ctypes-$mode" "$l" 120 "$PY" "$SRC/mem_ctypes.py" "$mode"
    local p
    for p in direct pa; do
      local what="exported symbols"
      [[ $p == pa ]] && what="cuGetProcAddress_v2 pointers"
      local name="3. ctypes $mode: $what"
      local exp="with: totalmem=info.total=4096MiB, 3GiB=0, +2GiB=2, free back; without: 0, 0"
      local bT bI b3 b2 lT lI l3 l2 lD why=""
      bT=$(kv "$b" ${p}_total_mem) bI=$(kv "$b" ${p}_info_total) b3=$(kv "$b" ${p}_alloc3g_rc) b2=$(kv "$b" ${p}_alloc2g_rc)
      lT=$(kv "$l" ${p}_total_mem) lI=$(kv "$l" ${p}_info_total) l3=$(kv "$l" ${p}_alloc3g_rc) l2=$(kv "$l" ${p}_alloc2g_rc)
      lD=$(kv "$l" ${p}_free_back_diff)
      why="$(exit_why "$b" base)$(exit_why "$l" lim)"
      ncmp "$b3" eq 0 || why+=" base-3GiB!=0"
      ncmp "$b2" eq 0 || why+=" base-2GiB!=0"
      ncmp "$lT" eq $QUOTA || why+=" totalmem!=quota"
      ncmp "$lI" eq $QUOTA || why+=" info.total!=quota"
      ncmp "$l3" eq 0 || why+=" 3GiB!=0"
      ncmp "$l2" eq 2 || why+=" 2GiB!=2"
      within "$lD" $SLACK || why+=" free-not-back($lD)"
      row "$name" \
        "totalmem=$(mibs "$bT") info=$(mibs "$bI") 3G=${b3:-?} 2G=${b2:-?}" \
        "totalmem=$(mibs "$lT") info=$(mibs "$lI") 3G=${l3:-?} 2G=${l2:-?} back=$(mibs "$lD")" \
        "$exp" "$why"
    done
  done
}

# api_field LOG API FIELD: value of FIELD=... on the line "API <API> ..."
api_field() {
  awk -v api="$2" -v key="$3" '$1=="API" && $2==api {
      for (i = 3; i <= NF; i++) { n = index($i, "="); if (substr($i, 1, n-1) == key) { print substr($i, n+1); exit } } }' "$1" 2>/dev/null
}

# 4: every allocation API
check_apis() {
  local apis=(cuMemAlloc_v2 cuMemAllocPitch_v2 cuMemAllocManaged cuMemAllocAsync cuMemAllocAsync_ptsz
    cuMemAllocFromPoolAsync cuMemAllocFromPoolAsync_ptsz cuMemCreate cuArrayCreate_v2
    cuArray3DCreate_v2 cuMipmappedArrayCreate)
  local exp="with: alloc=0 drop>=1GiB-2MiB over=2 back=ok; without: alloc=0 over=0 (managed: n/a)"
  local a
  if ! built mem_apis; then
    for a in "${apis[@]}"; do row "4. $a" "not built" "not built" "$exp" "build failed"; done
    return
  fi
  local b=$LOG_DIR/4-apis-base.log l=$LOG_DIR/4-apis-lim.log
  clean_shm
  run_prog base - "$b" 180 "$BIN/mem_apis"
  clean_shm
  run_prog lim e2e-apis "$l" 180 "$BIN/mem_apis" limited
  local lT
  lT=$(kv "$l" total)
  say "   mem_apis: limited cuMemGetInfo total=$(kv "$l" total) cuDeviceTotalMem=$(kv "$l" device_total) ptsz=$(kv "$l" ptsz_symbols)"
  for a in "${apis[@]}"; do
    local ba bdr bo bb la ldr lo lb why
    why="$(exit_why "$b" base)$(exit_why "$l" lim)"
    ba=$(api_field "$b" "$a" alloc) bdr=$(api_field "$b" "$a" drop) bo=$(api_field "$b" "$a" over) bb=$(api_field "$b" "$a" back)
    la=$(api_field "$l" "$a" alloc) ldr=$(api_field "$l" "$a" drop) lo=$(api_field "$l" "$a" over) lb=$(api_field "$l" "$a" back)
    if [[ -z $la ]]; then
      why+=" no-output-line"
    else
      ncmp "$ba" eq 0 || why+=" base-alloc!=0"
      if [[ $a == cuMemAllocManaged ]]; then
        [[ $bo == n/a ]] || why+=" base-over-attempted"
      else
        ncmp "$bo" eq 0 || why+=" base-over!=0"
      fi
      ncmp "$la" eq 0 || why+=" alloc!=0"
      ncmp "$ldr" ge $((GiB - SLACK)) || why+=" drop<1GiB"
      ncmp "$lo" eq 2 || why+=" over!=2"
      [[ $lb == ok ]] || why+=" not-given-back"
    fi
    row "4. $a" \
      "alloc=${ba:-?} drop=$(mibs "$bdr") over=${bo:-?} back=${bb:-?}" \
      "alloc=${la:-?} drop=$(mibs "$ldr") over=${lo:-?} back=${lb:-?}" \
      "$exp" "$why"
  done
  ncmp "$lT" eq $QUOTA || say "   note: mem_apis saw total=$lT under the limiter (expected $QUOTA)"
}

# 5: PyTorch
check_torch() {
  local name="5. PyTorch mem_get_info / OOM"
  local exp="with: total=4294967296, 2GiB ok, 5GiB -> torch.OutOfMemoryError; without: 5GiB ok"
  local b=$LOG_DIR/5-torch-base.log l=$LOG_DIR/5-torch-lim.log
  clean_shm
  run_prog base - "$b" 240 "$PY" "$SRC/mem_torch.py"
  clean_shm
  run_prog lim e2e-torch "$l" 240 "$PY" "$SRC/mem_torch.py"
  local bt ba bo lt la lo lf why
  why="$(exit_why "$b" base)$(exit_why "$l" lim)"
  bt=$(kv "$b" total) ba=$(kv "$b" alloc2g) bo=$(kv "$b" over)
  lt=$(kv "$l" total) la=$(kv "$l" alloc2g) lo=$(kv "$l" over) lf=$(kv "$l" free)
  [[ $ba == ok ]] || why+=" base-2GiB-failed"
  [[ $bo == ok ]] || why+=" base-5GiB-failed"
  ncmp "$lt" eq $QUOTA || why+=" total!=quota"
  ncmp "$lf" le $QUOTA || why+=" free>quota"
  [[ $la == ok ]] || why+=" 2GiB-failed"
  [[ $lo == oom ]] || why+=" 5GiB-not-OOM"
  row "$name" \
    "total=${bt:-?} 2G=${ba:-?} 5G=${bo:-?}" \
    "total=${lt:-?} free=$(mibs "$lf") 2G=${la:-?} 5G=${lo:-?}" \
    "$exp" "$why"
}

# 6: nvidia-smi under the preload (NVML nvmlDeviceGetMemoryInfo)
check_smi() {
  local name="6. nvidia-smi memory.total/used/free (MiB)"
  local exp="with: total=4096, used,free<=4096; without: total>8192"
  local b=$LOG_DIR/6-smi-base.log l=$LOG_DIR/6-smi-lim.log
  local q=(nvidia-smi -i 0 --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader,nounits)
  clean_shm
  run_prog base - "$b" 60 "${q[@]}"
  clean_shm
  run_prog lim e2e-smi "$l" 60 "${q[@]}"
  local bl ll bt lt lu lf why
  why="$(exit_why "$b" base)$(exit_why "$l" lim)"
  bl=$(grep -a -m1 -E '^[[:space:]]*[0-9]+[[:space:]]*,' "$b" | tr -d ' ')
  ll=$(grep -a -m1 -E '^[[:space:]]*[0-9]+[[:space:]]*,' "$l" | tr -d ' ')
  IFS=, read -r bt _ _ <<<"$bl"
  IFS=, read -r lt lu lf <<<"$ll"
  ncmp "$bt" gt 8192 || why+=" base-total<=8192"
  ncmp "$lt" eq $QUOTA_MIB || why+=" total!=4096"
  ncmp "$lu" le $QUOTA_MIB || why+=" used>4096"
  ncmp "$lf" le $QUOTA_MIB || why+=" free>4096"
  row "$name" "${bl:-?}" "${ll:-?}" "$exp" "$why"
}

# 7: two processes of one pod share one quota; a killed process gives back
pod_sequence() { # MODE TAG -> sets SEQ_A SEQ_BS SEQ_BO SEQ_C
  local mode=$1 tag=$2 sz=$((5 * GiB / 2))
  local flag=$WORK/release-$tag alog=$LOG_DIR/7-$tag-A.log
  rm -f "$flag"
  clean_shm
  env_for "$mode" e2e-shared
  {
    echo "# mode=$mode pod=e2e-shared (A, holds until $flag)"
    echo "# start $(date +%T.%N)"
  } >"$alog"
  "${ENVCMD[@]}" "$BIN/mem_hold" "$sz" "$flag" 120 >>"$alog" 2>&1 &
  local apid=$!
  BG_PIDS+=("$apid")
  local i
  for ((i = 0; i < 600; i++)); do
    grep -q '^holding=1' "$alog" 2>/dev/null && break
    grep -q '^alloc_rc=' "$alog" 2>/dev/null && ! grep -q '^alloc_rc=0' "$alog" && break
    kill -0 "$apid" 2>/dev/null || break
    sleep 0.1
  done
  SEQ_A=$(kv "$alog" alloc_rc)
  [[ -n $SEQ_A ]] || SEQ_A="none"
  run_prog "$mode" e2e-shared "$LOG_DIR/7-$tag-B-same.log" 60 "$BIN/mem_hold" "$sz"
  SEQ_BS=$(kv "$LOG_DIR/7-$tag-B-same.log" alloc_rc)
  run_prog "$mode" e2e-other "$LOG_DIR/7-$tag-B-other.log" 60 "$BIN/mem_hold" "$sz"
  SEQ_BO=$(kv "$LOG_DIR/7-$tag-B-other.log" alloc_rc)
  local alive=0
  kill -0 "$apid" 2>/dev/null && alive=1
  kill -9 "$apid" 2>/dev/null
  wait "$apid" 2>/dev/null
  echo "# A was alive before SIGKILL: $alive; killed at $(date +%T.%N)" >>"$alog"
  sleep 1
  run_prog "$mode" e2e-shared "$LOG_DIR/7-$tag-C.log" 60 "$BIN/mem_hold" "$sz"
  SEQ_C=$(kv "$LOG_DIR/7-$tag-C.log" alloc_rc)
  [[ $alive == 1 ]] || SEQ_A="$SEQ_A(died-early)"
  touch "$flag"
}

check_pods() {
  local name="7. one pod, two processes (2.5GiB each); SIGKILL gives back"
  local exp="with: A=0 B-same-pod=2 B-other-pod=0 C-after-kill=0; without: all 0"
  if ! built mem_hold; then
    row "$name" "not built" "not built" "$exp" "build failed"
    return
  fi
  pod_sequence base base
  local bA=$SEQ_A bBs=$SEQ_BS bBo=$SEQ_BO bC=$SEQ_C
  pod_sequence lim lim
  local lA=$SEQ_A lBs=$SEQ_BS lBo=$SEQ_BO lC=$SEQ_C why="" x
  for x in base-B-same base-B-other base-C lim-B-same lim-B-other lim-C; do
    why+=$(exit_why "$LOG_DIR/7-${x%%-*}-${x#*-}.log" "$x")
  done
  [[ "$bA $bBs $bBo $bC" == "0 0 0 0" ]] || why+=" baseline-not-all-0"
  [[ $lA == 0 ]] || why+=" A!=0"
  [[ $lBs == 2 ]] || why+=" B-same!=2"
  [[ $lBo == 0 ]] || why+=" B-other!=0"
  [[ $lC == 0 ]] || why+=" C-after-kill!=0"
  row "$name" "A=$bA Bsame=${bBs:-?} Bother=${bBo:-?} C=${bC:-?}" \
    "A=$lA Bsame=${lBs:-?} Bother=${lBo:-?} C=${lC:-?}" "$exp" "$why"
  clean_shm
}

# 8: 10,000 alloc/free pairs from 4 threads leave usage at zero
check_pairs() {
  local name="8. 10k cudaMalloc/cudaFree pairs, 4 threads"
  local exp="with: 10000 pairs, 0 errors, free back +-2MiB, alloc(free-64MiB)=0"
  if ! built mem_pairs; then
    row "$name" "not built" "not built" "$exp" "build failed"
    return
  fi
  local b=$LOG_DIR/8-pairs-base.log l=$LOG_DIR/8-pairs-lim.log
  clean_shm
  run_prog base - "$b" 180 "$BIN/mem_pairs"
  clean_shm
  run_prog lim e2e-pairs "$l" 180 "$BIN/mem_pairs"
  local bp be bd bg lp lae lfe ld lg lt why
  why="$(exit_why "$b" base)$(exit_why "$l" lim)"
  bp=$(kv "$b" pairs) be=$(kv "$b" alloc_errors) bd=$(kv "$b" free_diff) bg=$(kv "$b" big_rc)
  lp=$(kv "$l" pairs) lae=$(kv "$l" alloc_errors) lfe=$(kv "$l" free_errors) ld=$(kv "$l" free_diff)
  lg=$(kv "$l" big_rc) lt=$(kv "$l" total0)
  ncmp "$bp" eq 10000 || why+=" base-pairs!=10000"
  ncmp "$lt" eq $QUOTA || why+=" total!=quota"
  ncmp "$lp" eq 10000 || why+=" pairs!=10000"
  ncmp "$lae" eq 0 || why+=" alloc-errors"
  ncmp "$lfe" eq 0 || why+=" free-errors"
  within "$ld" $SLACK || why+=" free-not-back"
  ncmp "$lg" eq 0 || why+=" big-alloc!=0"
  row "$name" "pairs=${bp:-?} errs=${be:-?} diff=${bd:-?}B big=${bg:-?}" \
    "pairs=${lp:-?} errs=${lae:-?}/${lfe:-?} diff=${ld:-?}B big=${lg:-?} big_bytes=$(mibs "$(kv "$l" big_bytes)")" \
    "$exp" "$why"
}

# 9: added cost of cuMemAlloc_v2 + cuMemFree_v2
check_bench() {
  # The driver's own cost varies by +-20% from one process to the next, so
  # many short runs, alternating which goes first, and the medians.
  local rounds=11
  local name="9. cuMemAlloc_v2+cuMemFree_v2 (1MiB) ns/pair, median of $rounds"
  local exp="added <= 5%"
  if ! built mem_bench; then
    row "$name" "not built" "not built" "$exp" "build failed"
    return
  fi
  local i bs=() ls=() v
  local LIMITER_LOG=warn # timing: no info-level logging in the limited runs
  clean_shm
  bench_one() { # MODE POD TAG I
    run_prog "$1" "$2" "$LOG_DIR/9-bench-$3-$4.log" 120 "$BIN/mem_bench" 10000 2000
    v=$(kv "$LOG_DIR/9-bench-$3-$4.log" ns_per_pair)
  }
  for ((i = 1; i <= rounds; i++)); do
    if ((i % 2)); then
      bench_one base - base "$i"; bs+=("${v:-x}")
      bench_one lim e2e-bench lim "$i"; ls+=("${v:-x}")
    else
      bench_one lim e2e-bench lim "$i"; ls+=("${v:-x}")
      bench_one base - base "$i"; bs+=("${v:-x}")
    fi
  done
  say "   bench ns/pair without: ${bs[*]}  with: ${ls[*]}"
  local bm lm pct why=""
  bm=$(median "${bs[@]}")
  lm=$(median "${ls[@]}")
  if [[ -n $bm && -n $lm ]]; then
    pct=$(awk -v a="$bm" -v b="$lm" 'BEGIN{ if (a > 0) printf "%.2f", (b - a) * 100 / a; else print "x" }')
    awk -v p="$pct" 'BEGIN{ exit !(p != "x" && p <= 5) }' || why+=" added>5%"
  else
    pct="?"
    why+=" no-numbers"
  fi
  [[ ${bs[*]} == *x* || ${ls[*]} == *x* ]] && why+=" some-runs-failed"
  row "$name" "${bm:-?} ns" "${lm:-?} ns (${pct}%)" "$exp" "$why"
}

# 10: start-up cost of a non-CUDA program, and no libcuda mapped into it
check_spawn() {
  local exp="added < 1000 us"
  if ! built spawn_bench; then
    row "10. spawn /bin/true" "not built" "not built" "$exp" "build failed"
  else
    local i r0=() r1=() r2=() v
    local base=(env -u LD_PRELOAD -u CUDA_DEVICE_MEMORY_LIMIT -u CUDA_LIMITER_MEMORY_LIMIT -u CUDA_LIMITER_POD)
    for ((i = 1; i <= 3; i++)); do
      local f0=$LOG_DIR/10-spawn-base-$i.log f1=$LOG_DIR/10-spawn-preload-$i.log f2=$LOG_DIR/10-spawn-limit-$i.log
      timeout -k 5 120 "${base[@]}" "$BIN/spawn_bench" 1000 /bin/true >"$f0" 2>&1
      v=$(kv "$f0" mean_us)
      r0+=("${v:-x}")
      timeout -k 5 120 "${base[@]}" "$BIN/spawn_bench" 1000 /bin/true \
        LD_PRELOAD="$LIB" CUDA_LIMITER_LOG=warn >"$f1" 2>&1
      v=$(kv "$f1" mean_us)
      r1+=("${v:-x}")
      timeout -k 5 120 "${base[@]}" "$BIN/spawn_bench" 1000 /bin/true \
        LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_LIMIT=4g CUDA_LIMITER_POD=e2e-spawn CUDA_LIMITER_LOG=warn >"$f2" 2>&1
      v=$(kv "$f2" mean_us)
      r2+=("${v:-x}")
    done
    say "   spawn mean us: none=${r0[*]} preload=${r1[*]} preload+limit=${r2[*]}"
    local m0 m1 m2 d why
    m0=$(median "${r0[@]}")
    m1=$(median "${r1[@]}")
    m2=$(median "${r2[@]}")
    for v in 1 2; do
      local m=$m1 label="LD_PRELOAD only" runs="${r1[*]}"
      [[ $v == 2 ]] && { m=$m2; label="LD_PRELOAD + CUDA_DEVICE_MEMORY_LIMIT=4g"; runs="${r2[*]}"; }
      why=""
      if [[ -n $m0 && -n $m ]]; then
        d=$(awk -v a="$m0" -v b="$m" 'BEGIN{ printf "%+.1f", b - a }')
        awk -v d="$d" 'BEGIN{ exit !(d < 1000) }' || why+=" added>=1000us"
      else
        d="?"
        why+=" no-numbers"
      fi
      [[ "${r0[*]} $runs" == *x* ]] && why+=" some-runs-failed"
      row "10. spawn /bin/true x1000 ($label)" "${m0:-?} us" "${m:-?} us (${d} us)" "$exp" "$why"
    done
  fi

  # /bin/true-like program (cat) under the preload must not map libcuda.so
  local mb=$LOG_DIR/10-maps-base.log ml=$LOG_DIR/10-maps-lim.log
  # stderr apart: ld.so's "cannot be preloaded" message names the library too
  env -u LD_PRELOAD cat /proc/self/maps >"$mb" 2>"$LOG_DIR/10-maps-base-stderr.log"
  env LD_PRELOAD="$LIB" CUDA_DEVICE_MEMORY_LIMIT=4g CUDA_LIMITER_POD=e2e-spawn CUDA_LIMITER_LOG=warn \
    cat /proc/self/maps >"$ml" 2>"$LOG_DIR/10-maps-lim-stderr.log"
  local bc lc lcl why=""
  bc=$(grep -c -F 'libcuda.so' "$mb")
  lc=$(grep -c -F 'libcuda.so' "$ml")
  lcl=$(grep -c -F 'libcuda_limiter' "$ml")
  ncmp "$lc" eq 0 || why+=" libcuda-mapped"
  ncmp "$lcl" ge 1 || why+=" limiter-not-mapped"
  row "10. cat /proc/self/maps under preload: libcuda.so mappings" \
    "libcuda.so=$bc" "libcuda.so=$lc limiter=$lcl" "libcuda.so=0, limiter>=1" "$why"
}

# ------------------------------------------------------- compute checks --

SPIN_T=$((3 * SHARE_SECS + 20)) # timeout of one spin run, seconds
SHARE_LIMITS=(10 25 50 75)
SHARE_DURS=(50 2000)
SHARE_KMODES=(runtime graph)

# spin_run MODE POD LOG KMODE DUR_US [DUMP GO]: one spin run of SHARE_SECS seconds
spin_run() {
  local mode=$1 pod=$2 log=$3
  shift 3
  clean_shm
  run_prog "$mode" "$pod" "$log" "$SPIN_T" "$BIN/spin" "$1" "$2" "$SHARE_SECS" "${@:3}"
}

# timed_out LOG: the run in LOG hit its timeout
timed_out() {
  local e
  e=$(exitof "$1")
  [[ $e == 124 || $e == 137 ]]
}

# spin_why LOG TAG: reasons a spin log is unusable (did not exit 0, no ok=1)
spin_why() {
  local w
  w=$(exit_why "$1" "$2")
  [[ $(kv "$1" ok) == 1 ]] || w+=" $2-not-ok"
  printf '%s' "$w"
}

# 11: busy share of one process for every limit x kernel length x launch API
check_share() {
  local dur km L
  if ! built spin; then
    for dur in "${SHARE_DURS[@]}"; do
      for km in "${SHARE_KMODES[@]}"; do
        for L in "${SHARE_LIMITS[@]}"; do
          row "11. busy share L=$L% kernel ${dur}us $km" "not built" "not built" "-" "build failed"
        done
      done
    done
    return
  fi
  local hung=0
  for dur in "${SHARE_DURS[@]}"; do
    for km in "${SHARE_KMODES[@]}"; do
      local b=$LOG_DIR/11-spin-$km-${dur}us-base.log
      spin_run base - "$b" "$km" "$dur"
      local bb bs bn bwhy
      bb=$(kv "$b" busy_pct) bs=$(kv "$b" max_stall_us) bn=$(kv "$b" kernels)
      bwhy=$(spin_why "$b" base)
      fok 'a >= 85' "$bb" || bwhy+=" base-busy<85%"
      for L in "${SHARE_LIMITS[@]}"; do
        local l=$LOG_DIR/11-spin-$km-${dur}us-L$L.log
        if ((hung >= 2)); then # a hanging limiter would cost SPIN_T per run
          row "11. busy share L=$L% kernel ${dur}us $km" "busy=${bb:-?}%" "skipped" "-" \
            "skipped after 2 limited runs in a row timed out"
          continue
        fi
        spin_run "sm:$L" "e2e-c11-$km-$dur-L$L" "$l" "$km" "$dur"
        if timed_out "$l"; then hung=$((hung + 1)); else hung=0; fi
        local ls lset lsd lf lst ln why=$bwhy
        ls=$(kv "$l" share_after1s_pct) lset=$(kv "$l" settle_ms) lsd=$(kv "$l" settled)
        lf=$(kv "$l" share_first1s_pct) lst=$(kv "$l" max_stall_us) ln=$(kv "$l" kernels)
        why+=$(spin_why "$l" lim)
        fok 'a - b <= 3 && b - a <= 3' "$ls" "$L" || why+=" share-off-by>3pp"
        [[ $lsd == 1 ]] && fok 'a >= 0 && a <= 1000' "$lset" || why+=" settle>1s"
        row "11. busy share L=$L% kernel ${dur}us $km" \
          "busy=${bb:-?}% maxstall=${bs:-?}us n=${bn:-?}" \
          "share=${ls:-?}% settle=${lset:-?}ms first1s=${lf:-?}% maxstall=${lst:-?}us n=${ln:-?}" \
          "share(1s..end)=${L}+-3%, settle<=1000ms; without: busy>=85%" "$why"
      done
    done
  done
  clean_shm
}

# series_summary LIST LO HI: "first min max n_later n_outside" of a per-mille
# list; min/max/outside over the windows after the first, outside [LO, HI]
series_summary() {
  [[ ${1:-} =~ ^[0-9]+(,[0-9]+)*$ ]] || { printf '? ? ? 0 0'; return; }
  awk -v s="$1" -v lo="$2" -v hi="$3" 'BEGIN{
      n = split(s, w, ","); mn = "?"; mx = "?"; bad = 0
      for (i = 2; i <= n; i++) {
        v = w[i] + 0
        if (mn == "?" || v < mn) mn = v
        if (mx == "?" || v > mx) mx = v
        if (v < lo || v > hi) bad++
      }
      printf "%s %s %s %d %d", w[1], mn, mx, n - 1, bad }'
}

# pm2pct X: per-mille to percent ("?" stays)
pm2pct() { fcalc '%.1f' 'a / 10' "$1"; }

# 12: per-second series of one representative run (from check 11 when it ran)
check_series() {
  local L=25 dur=2000 km=runtime
  local name="12. per-second busy, L=$L% kernel ${dur}us $km"
  local exp="with: every 1 s window after the first within ${L}+-3%; without: all >=85%"
  if ! built spin; then
    row "$name" "not built" "not built" "$exp" "build failed"
    return
  fi
  local b=$LOG_DIR/11-spin-$km-${dur}us-base.log l=$LOG_DIR/11-spin-$km-${dur}us-L$L.log
  if [[ ! -f $b || ! -f $l ]]; then
    b=$LOG_DIR/12-spin-$km-${dur}us-base.log l=$LOG_DIR/12-spin-$km-${dur}us-L$L.log
    spin_run base - "$b" "$km" "$dur"
    spin_run "sm:$L" "e2e-c12-$km-$dur-L$L" "$l" "$km" "$dur"
  fi
  local bw lw
  bw=$(kv "$b" windows_pm) lw=$(kv "$l" windows_pm)
  say "   series from $(basename "$l") (per-mille busy)"
  say "   1 s windows without: ${bw:-?}"
  say "   1 s windows with:    ${lw:-?}"
  say "   100 ms windows with: $(kv "$l" windows100_pm)"
  local bf bmn bmx bn bbad lf lmn lmx ln lbad why
  read -r bf bmn bmx bn bbad <<<"$(series_summary "$bw" 850 1000)"
  read -r lf lmn lmx ln lbad <<<"$(series_summary "$lw" $(((L - 3) * 10)) $(((L + 3) * 10)))"
  why="$(spin_why "$b" base)$(spin_why "$l" lim)"
  fok 'a >= 850' "$bf" || why+=" base-first<85%"
  ncmp "$bbad" eq 0 || why+=" base-window<85%"
  ncmp "$ln" ge 1 || why+=" fewer-than-2-windows"
  ncmp "$lbad" eq 0 || why+=" $lbad-window(s)-outside"
  row "$name" \
    "first=$(pm2pct "$bf")% later=$(pm2pct "$bmn")..$(pm2pct "$bmx")%" \
    "first=$(pm2pct "$lf")% later=$(pm2pct "$lmn")..$(pm2pct "$lmx")% (${ln:-0} windows)" \
    "$exp" "$why"
}

# smi_sample_start LOG / smi_sample_stop: nvidia-smi clocks/power once a second
smi_sample_start() {
  env -u LD_PRELOAD nvidia-smi \
    --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
    --format=csv -lms 1000 >"$1" 2>&1 &
  SMI_PID=$!
  BG_PIDS+=("$SMI_PID")
}
smi_sample_stop() {
  [[ -n ${SMI_PID:-} ]] || return 0
  kill "$SMI_PID" 2>/dev/null
  wait "$SMI_PID" 2>/dev/null
  SMI_PID=
}

# 13: PyTorch bf16 matmul throughput under a compute limit
check_torch_share() {
  local r t=$((TORCH_SECS + 90))
  for r in base 25 50; do
    local log=$LOG_DIR/13-torch-$r.log mode=base pod=-
    [[ $r == base ]] || { mode=sm:$r; pod=e2e-c13-L$r; }
    clean_shm
    smi_sample_start "$LOG_DIR/13-torch-$r-smi.log"
    run_prog "$mode" "$pod" "$log" "$t" "$PY" "$SRC/torch_matmul.py" "$TORCH_SECS" 2
    smi_sample_stop
  done
  clean_shm
  local b=$LOG_DIR/13-torch-base.log br bt L bclk
  br=$(kv "$b" matmuls_per_s) bt=$(kv "$b" tflops)
  bclk=$(smi_mean "$LOG_DIR/13-torch-base-smi.log" 2)
  for L in 25 50; do
    local l=$LOG_DIR/13-torch-$L.log lr lt ratio why util lclk
    lr=$(kv "$l" matmuls_per_s) lt=$(kv "$l" tflops)
    ratio=$(fcalc '%.4f' 'b / a' "$br" "$lr")
    util=$(smi_mean "$LOG_DIR/13-torch-$L-smi.log" 6)
    lclk=$(smi_mean "$LOG_DIR/13-torch-$L-smi.log" 2)
    why="$(spin_why "$b" base)$(spin_why "$l" lim)"
    fok 'a > 0' "$br" || why+=" no-base-rate"
    fok 'a - b <= 3 && b - a <= 3' "$util" "$L" || why+=" gpu-time-share-off-by>3pp"
    row "13. PyTorch bf16 matmul loop, GPU time share (nvidia-smi utilization.gpu), L=$L%" \
      "100% busy, SM clock ${bclk:-?} MHz (power-capped)" "${util:-?}% busy, SM clock ${lclk:-?} MHz" \
      "share = $L +- 3 pp" "$why"
    row "13. PyTorch bf16 8192^2 matmul/s, L=$L% (throughput ratio)" \
      "${br:-?}/s (${bt:-?} TFLOPS)" "${lr:-?}/s (${lt:-?} TFLOPS) ratio=$ratio" \
      "reported: at L% the GPU runs at full clock, unlimited it is power-capped" INFO
  done
}

# smi_mean LOG FIELD: mean of a numeric column of the nvidia-smi samples taken
# while the GPU was busy (utilization > 0), the first busy sample skipped
smi_mean() {
  awk -F', ' -v f="$2" 'NR > 1 && $6 + 0 > 0 { n++; if (n > 1) { s += $f + 0; c++ } }
    END { if (c) printf "%.1f", s / c }' "$1" 2>/dev/null
}

# overhead_row NAME UNIT EXPECTED_MAX_PCT "BASE..." "LIM..." MODE_LOG_GLOB: median row
overhead_row() {
  local name=$1 max=$2 bs=($3) ls=($4)
  local bm lm pct why=""
  bm=$(median "${bs[@]}")
  lm=$(median "${ls[@]}")
  if [[ -n $bm && -n $lm ]]; then
    pct=$(fcalc '%.2f' '(b - a) * 100 / a' "$bm" "$lm")
    fok "a <= $max" "$pct" || why+=" added>$max%"
  else
    pct="?"
    why+=" no-numbers"
  fi
  [[ "${bs[*]} ${ls[*]}" == *x* ]] && why+=" some-runs-failed"
  row "$name" "${bm:-?} ns" "${lm:-?} ns (${pct}%)" "added <= $max%" "$why"
}

# 14: launch cost with the limiter loaded (no limit) and under a non-binding limit
check_launch() {
  local n1="14. 200k empty-kernel launches, ns/launch, median of 9 (limiter active with a memory quota, no compute limit)"
  local n2="14. 20us host work + 1 empty launch x20k, ns/iteration, median of 9 ($SM_VAR=50)"
  if ! built launch_overhead; then
    row "$n1" "not built" "not built" "added <= 1%" "build failed"
    row "$n2" "not built" "not built" "added <= 3%" "build failed"
    return
  fi
  local LIMITER_LOG=warn # timing: no info-level logging in the limited runs
  local i v hung=0 tb=() tl=() pb=() pl=() cb=() cl=()
  # one_run MODE POD TEST TAG I: sets v to the number (empty when none)
  one_run() {
    local f=$LOG_DIR/14-$3-$4-$5.log key=throughput_ns_per_launch
    [[ $3 == pace ]] && key=pace_ns_per_iter
    v=""
    if [[ $1 != base ]] && ((hung >= 2)); then
      echo "# skipped: 2 limited runs timed out" >"$f"
      return
    fi
    clean_shm
    run_prog "$1" "$2" "$f" 30 "$BIN/launch_overhead" "$3"
    [[ $1 != base ]] && timed_out "$f" && hung=$((hung + 1))
    v=$(kv "$f" "$key")
    [[ $(kv "$f" ok) == 1 ]] || v=""
  }
  for ((i = 1; i <= 9; i++)); do
    # alternate which goes first, so slow drift cancels out
    if ((i % 2)); then
      one_run base - throughput base "$i"; tb+=("${v:-x}")
      one_run pre - throughput pre "$i"; tl+=("${v:-x}")
      one_run base - pace base "$i"; pb+=("${v:-x}")
      one_run sm:50 e2e-c14-pace pace L50 "$i"; pl+=("${v:-x}")
    else
      one_run pre - throughput pre "$i"; tl+=("${v:-x}")
      one_run base - throughput base "$i"; tb+=("${v:-x}")
      one_run sm:50 e2e-c14-pace pace L50 "$i"; pl+=("${v:-x}")
      one_run base - pace base "$i"; pb+=("${v:-x}")
    fi
    cb+=("$(kv "$LOG_DIR/14-pace-base-$i.log" pace_launch_ns)")
    cl+=("$(kv "$LOG_DIR/14-pace-L50-$i.log" pace_launch_ns)")
  done
  clean_shm
  say "   launch throughput ns/launch without: ${tb[*]}  with (preload, no limit): ${tl[*]}"
  say "   pace ns/iteration without: ${pb[*]}  with ($SM_VAR=50): ${pl[*]}"
  say "   pace ns inside the launch call without: ${cb[*]}  with: ${cl[*]}"
  overhead_row "$n1" 1 "${tb[*]}" "${tl[*]}"
  overhead_row "$n2" 3 "${pb[*]}" "${pl[*]}"
}

# spin_pair TAG MODE_A POD_A MODE_B POD_B: two spin runtime 2000us runs started
# together (a go file releases both once both are ready); sets PAIR_U, the log
# of the union of their intervals
spin_pair() {
  local tag=$1 go=$WORK/go-15-$1
  local la=$LOG_DIR/15-$tag-A.log lb=$LOG_DIR/15-$tag-B.log
  local da=$WORK/15-$tag-A.intervals db=$WORK/15-$tag-B.intervals
  local t=$((SPIN_T + 30))
  PAIR_U=$LOG_DIR/15-$tag-union.log
  rm -f "$go" "$da" "$db" "$la" "$lb"
  clean_shm
  run_prog "$2" "$3" "$la" "$t" "$BIN/spin" runtime 2000 "$SHARE_SECS" "$da" "$go" &
  local pa=$!
  run_prog "$4" "$5" "$lb" "$t" "$BIN/spin" runtime 2000 "$SHARE_SECS" "$db" "$go" &
  local pb=$!
  BG_PIDS+=("$pa" "$pb")
  local i
  for ((i = 0; i < 600; i++)); do
    grep -q '^ready=1' "$la" 2>/dev/null && grep -q '^ready=1' "$lb" 2>/dev/null && break
    kill -0 "$pa" 2>/dev/null && kill -0 "$pb" 2>/dev/null || break
    sleep 0.1
  done
  touch "$go"
  wait "$pa"
  wait "$pb"
  {
    echo "# spin union $da $db"
    timeout -k 5 60 "$BIN/spin" union "$da" "$db"
    echo "# exit=$?"
  } >"$PAIR_U" 2>&1
  clean_shm
}

# pair_why TAG: reasons the pair TAG's logs are unusable
pair_why() {
  printf '%s%s%s' "$(spin_why "$LOG_DIR/15-$1-A.log" "$1-A")" "$(spin_why "$LOG_DIR/15-$1-B.log" "$1-B")" \
    "$(spin_why "$LOG_DIR/15-$1-union.log" "$1-union")"
}

# pair_desc UNION_LOG: "union=S% (A=x% B=y%)"
pair_desc() {
  printf 'union=%s%% (A=%s%% B=%s%%) settle=%sms' "$(kv "$1" share_after1s_pct)" \
    "$(kv "$1" file0_share_after1s_pct)" "$(kv "$1" file1_share_after1s_pct)" "$(kv "$1" settle_ms)"
}

# 15: two processes at once, in one pod (one budget) and in two pods
check_pod_share() {
  local n1="15. two processes, ONE pod, L=50% (spin 2000us runtime): combined busy from 1 s"
  local n2="15. two processes, TWO pods, L=50% each: combined busy from 1 s"
  if ! built spin; then
    row "$n1" "not built" "not built" "50+-3%" "build failed"
    row "$n2" "not built" "not built" ">=90%" "build failed"
    return
  fi
  spin_pair base base - base -
  spin_pair same sm:50 e2e-c15-shared sm:50 e2e-c15-shared
  spin_pair two sm:50 e2e-c15-a sm:50 e2e-c15-b
  local ub=$LOG_DIR/15-base-union.log us=$LOG_DIR/15-same-union.log ut=$LOG_DIR/15-two-union.log
  local bwhy why
  bwhy=$(pair_why base)
  fok 'a >= 90' "$(kv "$ub" share_after1s_pct)" || bwhy+=" base-union<90%"
  why="$bwhy$(pair_why same)"
  fok 'a - 50 <= 3 && 50 - a <= 3' "$(kv "$us" share_after1s_pct)" || why+=" union-off-by>3pp"
  row "$n1" "$(pair_desc "$ub")" "$(pair_desc "$us")" "union=50+-3%; without: >=90%" "$why"
  why="$bwhy$(pair_why two)"
  fok 'a >= 90' "$(kv "$ut" share_after1s_pct)" || why+=" union<90%"
  row "$n2" "$(pair_desc "$ub")" "$(pair_desc "$ut")" "union>=90%; without: >=90%" "$why"
}

# ---------------------------------------------------- hypervisor checks --
#
# Checks 16-19 run the node daemon (gpu-bundle/hypervisor) on 127.0.0.1, on a
# port the kernel picks (listen = "127.0.0.1:0"; the daemon prints the address
# it bound), with a config written to $WORK/hv-<check>.toml. The limited spin
# processes run in hypervisor mode (CUDA_LIMITER_HYPERVISOR, _POD, _TOKEN):
# their pod's compute rate comes from the region the daemon writes. Every
# check stops its daemon (SIGTERM, SIGKILL after 3 s) and removes the regions;
# the EXIT trap kills whatever is left. Times "t" are seconds after the go
# file released the spin processes; the analysis measures from the first
# kernel (a few ms later), with scripts/gpu/hv_intervals.py.

HV_LOG_LEVEL=${E2E_HV_LOG:-info}
HV_ADMIN="e2e-admin-$$-$RANDOM"
HVBIN=""
HVLAT=""
HV_PID=""
HV_URL=""
HV_PORT=""
HV_LOGFILE=""
HV_ERR=""
T_GO=""
HV_B_WEIGHT=${E2E_HV_B_WEIGHT:-1}
[[ $HV_B_WEIGHT =~ ^[1-9][0-9]*$ ]] || HV_B_WEIGHT=1

hv_token() { printf 'e2e-tok-%s' "$1"; }

# hv_prepare: copies the daemon (and its latency test) out of the bundle, executable
hv_prepare() {
  local src=${E2E_HYPERVISOR:-$BUNDLE/hypervisor} lat=$BUNDLE/hypervisor-latency-test
  local log=$LOG_DIR/00-hypervisor-binaries.log
  {
    echo "hypervisor: $src"
    ls -la "$src" "$lat" 2>&1
  } >"$log"
  if [[ -f $src ]] && cp "$src" "$WORK/hypervisor" 2>>"$log" && chmod +x "$WORK/hypervisor"; then
    HVBIN=$WORK/hypervisor
    timeout -k 2 10 env -u LD_PRELOAD "$HVBIN" --version >>"$log" 2>&1
    say "hypervisor: $src"
  else
    say "hypervisor: $src missing; checks 16-19 will fail"
  fi
  if [[ -f $lat ]] && cp "$lat" "$WORK/hypervisor-latency-test" 2>>"$log" && chmod +x "$WORK/hypervisor-latency-test"; then
    HVLAT=$WORK/hypervisor-latency-test
  fi
}

# hv_prereq: false (HV_WHY says why) when the daemon or spin is missing
hv_prereq() {
  HV_WHY=""
  [[ -n $HVBIN ]] || HV_WHY="no hypervisor binary"
  built spin || HV_WHY+="${HV_WHY:+; }spin not built"
  [[ -f $LIB ]] || HV_WHY+="${HV_WHY:+; }no $LIB"
  [[ -z $HV_WHY ]]
}

# hv_pod ID LINE...: one [[pods]] section on GPU index 0 with the given lines
hv_pod() {
  local id=$1
  shift
  printf '[[pods]]\nid = "%s"\ntoken = "%s"\n[[pods.gpus]]\nindex = 0\n' "$id" "$(hv_token "$id")"
  printf '%s\n' "$@"
  echo
}

# hv_config FILE: the header, then the pod sections read from stdin
hv_config() {
  {
    echo "# written by scripts/gpu-e2e.sh"
    echo 'listen = "127.0.0.1:0"'
    echo "admin_token = \"$HV_ADMIN\""
    echo
    cat
  } >"$1"
}

# hvctl ARGS...: the API helper, bounded
hvctl() { timeout -k 2 "${HVCTL_T:-15}" "$PY" "$SRC/hvctl.py" "$@" 2>&1; }

# hv_start TAG CONFIG [PORT]: starts the daemon (on PORT, else one the kernel
# picks) and waits until its status answers; sets HV_PID HV_URL HV_PORT
# HV_LOGFILE, or HV_ERR and returns 1
hv_start() {
  local tag=$1 cfg=$2 port=${3:-}
  HV_ERR=""
  HV_LOGFILE=$LOG_DIR/$tag-hypervisor.log
  [[ -n $port ]] && HV_LOGFILE=$LOG_DIR/$tag-hypervisor-restart.log
  {
    echo "# config $cfg:"
    cat "$cfg"
    if [[ -z $port ]]; then # a restart goes straight to serve
      echo "# hypervisor check-config:"
      timeout -k 2 20 env -u LD_PRELOAD "$HVBIN" check-config --config "$cfg"
      echo "# check-config exit=$?"
    fi
    echo "# serve start $(date +%T.%N)${port:+ on port $port}"
  } >"$HV_LOGFILE" 2>&1
  local -a args=(serve --config "$cfg")
  [[ -n $port ]] && args+=(--listen "127.0.0.1:$port")
  [[ ${E2E_HV_SIMULATE:-} =~ ^[1-9]$ ]] && args+=(--simulate-gpus "$E2E_HV_SIMULATE")
  (exec env -u LD_PRELOAD HYPERVISOR_LOG="$HV_LOG_LEVEL" "$HVBIN" "${args[@]}") >>"$HV_LOGFILE" 2>&1 &
  HV_PID=$!
  BG_PIDS+=("$HV_PID")
  local i addr=""
  for ((i = 0; i < 300; i++)); do
    addr=$(grep -a -m1 -oE 'hypervisor listening on [0-9.]+:[0-9]+' "$HV_LOGFILE" | awk '{print $4}')
    [[ -n $addr ]] && break
    kill -0 "$HV_PID" 2>/dev/null || break
    sleep 0.05
  done
  if [[ -z $addr ]]; then
    HV_ERR="hypervisor did not start: $(sed -n '/^# serve start/,$p' "$HV_LOGFILE" | grep -a -v '^#' | tail -n 2 | tr '\n' ' ' | cut -c1-200)"
    say "   $HV_ERR (log $HV_LOGFILE)"
    return 1
  fi
  HV_URL=http://$addr
  HV_PORT=${addr##*:}
  local up=$LOG_DIR/$tag-hypervisor-up.log
  [[ -n $port ]] && up=$LOG_DIR/$tag-hypervisor-restart-up.log
  hvctl "$HV_URL" wait-up 10 >"$up"
  if [[ $(kv "$up" ok) != 1 ]]; then
    HV_ERR="hypervisor status does not answer on $HV_URL"
    say "   $HV_ERR"
    return 1
  fi
  say "   hypervisor pid $HV_PID on $HV_URL (up in $(kv "$up" up_ms) ms after listening)"
  return 0
}

# hv_stop: SIGTERM, SIGKILL after 3 s, reaped
hv_stop() {
  [[ -n ${HV_PID:-} ]] || return 0
  local i
  if kill -0 "$HV_PID" 2>/dev/null; then
    kill -TERM "$HV_PID" 2>/dev/null
    for ((i = 0; i < 60; i++)); do
      kill -0 "$HV_PID" 2>/dev/null || break
      sleep 0.05
    done
    kill -0 "$HV_PID" 2>/dev/null && { kill -KILL "$HV_PID" 2>/dev/null; echo "# SIGKILL after 3 s" >>"$HV_LOGFILE"; }
  fi
  wait "$HV_PID" 2>/dev/null
  echo "# stopped $(date +%T.%N) (exit $?)" >>"$HV_LOGFILE"
  HV_PID=""
}

# hv_status TAG: status snapshot into $LOG_DIR/TAG-status.log (key=value) and .json
hv_status() {
  HVCTL_T=5 hvctl "$HV_URL" status "$LOG_DIR/$1-status.json" >"$LOG_DIR/$1-status.log"
}

# hv_placed TAG POD...: reasons when a pod is not placed on the GPU
hv_placed() {
  local tag=$1 p w=""
  shift
  hv_status "$tag"
  for p in "$@"; do
    [[ $(kv "$LOG_DIR/$tag-status.log" "pod_${p}_placed") == 1 ]] || w+=" $p-not-placed-on-gpu0"
  done
  printf '%s' "$w"
}

# hv_registered STATUS_LOG POD...: reasons when a pod has no worker listed
hv_registered() {
  local st=$1 p w=""
  shift
  for p in "$@"; do
    ncmp "$(kv "$st" "pod_${p}_workers")" ge 1 || w+=" $p-no-worker-registered"
  done
  printf '%s' "$w"
}

# hv_spin TAG POD SECS GO: spin runtime 2000us for SECS under the hypervisor, in
# the background, released by GO; log $LOG_DIR/TAG.log, intervals $WORK/TAG.intervals
hv_spin() {
  local tag=$1 pod=$2 secs=$3 go=$4
  local log=$LOG_DIR/$tag.log dump=$WORK/$tag.intervals
  rm -f "$log" "$dump"
  run_prog hv "$pod" "$log" $((${secs%.*} + 60)) "$BIN/spin" runtime 2000 "$secs" "$dump" "$go" &
  HS_PID=$!
  BG_PIDS+=("$HS_PID")
}

# hv_wait_ready LOG...: until every LOG says ready=1 (40 s at most), or one exited
hv_wait_ready() {
  local i l n
  for ((i = 0; i < 400; i++)); do
    n=0
    for l in "$@"; do
      grep -q '^ready=1' "$l" 2>/dev/null && n=$((n + 1))
      grep -q '^# exit=' "$l" 2>/dev/null && return 1
    done
    ((n == $#)) && return 0
    sleep 0.1
  done
  return 1
}

# hv_go GO: releases the processes waiting on GO; T_GO = now (epoch seconds)
hv_go() {
  touch "$1"
  T_GO=$(date +%s.%N)
}

# t_abs T: epoch seconds of T_GO + T
t_abs() { awk -v g="$T_GO" -v t="$1" 'BEGIN{ printf "%.6f", g + t }'; }

# sleep_until T: sleeps until T_GO + T seconds
sleep_until() {
  local d
  d=$(awk -v g="$T_GO" -v t="$1" -v n="$(date +%s.%N)" 'BEGIN{ d = g + t - n; printf "%.3f", (d > 0 ? d : 0) }')
  sleep "$d"
}

# since EPOCH: seconds from T_GO to EPOCH ("?" when EPOCH is not a number)
since() { fcalc '%.3f' 'a - b' "${1:-x}" "$T_GO"; }

# now_t: seconds from T_GO to now
now_t() { since "$(date +%s.%N)"; }

# hv_analyse OUT ARGS...: hv_intervals.py into OUT
hv_analyse() {
  local out=$1
  shift
  {
    echo "# hv_intervals.py $*"
    timeout -k 2 60 "$PY" "$SRC/hv_intervals.py" "$@"
    echo "# exit=$?"
  } >"$out" 2>&1
}

# pct_from_ppm PPM: percent with one decimal ("?" when not a number)
pct_from_ppm() { fcalc '%.1f' 'a / 10000' "$1"; }

# near A B TOL: |A - B| <= TOL (all numbers)
near() { fok 'a - b <= c && b - a <= c' "$1" "$2" "$3"; }

# hv_end: daemon stopped, regions removed
hv_end() {
  hv_stop
  clean_shm
}

# 16: two pods, weights 1 and 3, both busy at once
check_hv_weighted() {
  local a=e2e-c16-a b=e2e-c16-b
  local name="16. hypervisor weighted sharing: pods A (weight 1) and B (weight 3), policy fixed, no cap; spin 2000us runtime 4 s each, at once: own busy share from 1 s (common span)"
  local exp="A=25+-3%, B=75+-3%"
  hv_prereq || { row "$name" "-" "-" "$exp" "$HV_WHY"; return; }
  local cfg=$WORK/hv-16.toml go=$WORK/go-16 why=""
  {
    hv_pod "$a" 'weight = 1' 'policy = "fixed"'
    hv_pod "$b" 'weight = 3' 'policy = "fixed"'
  } | hv_config "$cfg"
  clean_shm
  rm -f "$go"
  if ! hv_start 16 "$cfg"; then
    row "$name" "-" "-" "$exp" "$HV_ERR"
    hv_end
    return
  fi
  why+=$(hv_placed 16-start "$a" "$b")
  local la=$LOG_DIR/16-A.log lb=$LOG_DIR/16-B.log pa pb
  hv_spin 16-A "$a" 4 "$go"
  pa=$HS_PID
  hv_spin 16-B "$b" 4 "$go"
  pb=$HS_PID
  hv_wait_ready "$la" "$lb" || why+=" not-ready"
  hv_go "$go"
  sleep_until 2.5
  hv_status 16-mid
  wait "$pa"
  wait "$pb"
  hv_end
  local u=$LOG_DIR/16-union.log an=$LOG_DIR/16-analysis.log
  {
    echo "# spin union A B"
    timeout -k 5 60 "$BIN/spin" union "$WORK/16-A.intervals" "$WORK/16-B.intervals"
    echo "# exit=$?"
  } >"$u" 2>&1
  hv_analyse "$an" --origin common --win after1s:start+1:end --series all:start:end \
    "$WORK/16-A.intervals" "$WORK/16-B.intervals"
  local sa sb su ov st=$LOG_DIR/16-mid-status.log ra rb
  sa=$(kv "$u" file0_share_after1s_pct) sb=$(kv "$u" file1_share_after1s_pct) su=$(kv "$u" share_after1s_pct)
  ov=$(kv "$an" win_after1s_overlap_pct)
  ra=$(pct_from_ppm "$(kv "$st" "pod_${a}_rate_ppm")") rb=$(pct_from_ppm "$(kv "$st" "pod_${b}_rate_ppm")")
  why+=$(hv_registered "$st" "$a" "$b")
  say "   16: at t=2.5 s: workers A=$(kv "$st" "pod_${a}_workers") B=$(kv "$st" "pod_${b}_workers"), admissions $(kv "$st" admission_count) ($(kv "$st" admission_timeouts) timed out)"
  say "   16: A 100 ms series (per-mille): $(kv "$an" series_all_f0_pm)"
  say "   16: B 100 ms series (per-mille): $(kv "$an" series_all_f1_pm)"
  why+="$(spin_why "$la" A)$(spin_why "$lb" B)"
  [[ $(kv "$u" ok) == 1 ]] || why+=" union-failed"
  near "$sa" 25 3 || why+=" A-off-by>3pp"
  near "$sb" 75 3 || why+=" B-off-by>3pp"
  row "$name" "-" \
    "A=${sa:-?}% B=${sb:-?}% (union ${su:-?}%, overlap ${ov:-?}%; granted at t=2.5 s A=${ra}% B=${rb}%)" \
    "$exp" "$why"
}

# 17: a fixed cap alone; an elastic pod alone, then contended
check_hv_caps() {
  local n1="17a. hypervisor cap: pod A cap = 30, policy fixed, alone; spin 2000us runtime 3 s: busy share from 1 s"
  local fair target
  fair=$(fcalc '%.1f' '100 / (1 + a)' "$HV_B_WEIGHT")
  target=$(fcalc '%.1f' '(a > 30 ? a : 30)' "$fair")
  local n2="17b. hypervisor elastic: pod A share = 30, policy elastic, weight 1, alone 2 s; then pod B (weight $HV_B_WEIGHT, policy fixed, no cap) for 3 s. A's contended share = max(guaranteed 30, weighted fair ${fair}) = ${target}% (water-filling: floors first, then weights)"
  local e1="A=30+-3%" e2="A alone [0.5 s, 2 s] >= 90%; A over [B start + 1 s, B end] = ${target}+-3%"
  if ! hv_prereq; then
    row "$n1" "-" "-" "$e1" "$HV_WHY"
    row "$n2" "-" "-" "$e2" "$HV_WHY"
    return
  fi

  # (a) cap 30, fixed, alone
  local a=e2e-c17a-a cfg=$WORK/hv-17a.toml go=$WORK/go-17a why=""
  hv_pod "$a" 'cap = 30' 'policy = "fixed"' | hv_config "$cfg"
  clean_shm
  rm -f "$go"
  if hv_start 17a "$cfg"; then
    why+=$(hv_placed 17a-start "$a")
    local l=$LOG_DIR/17a-A.log p
    hv_spin 17a-A "$a" 3 "$go"
    p=$HS_PID
    hv_wait_ready "$l" || why+=" not-ready"
    hv_go "$go"
    sleep_until 2
    hv_status 17a-mid
    wait "$p"
    hv_end
    local s set r
    s=$(kv "$l" share_after1s_pct) set=$(kv "$l" settle_ms)
    r=$(pct_from_ppm "$(kv "$LOG_DIR/17a-mid-status.log" "pod_${a}_rate_ppm")")
    say "   17a: A 100 ms series (per-mille): $(kv "$l" windows100_pm)"
    why+=$(spin_why "$l" A)
    why+=$(hv_registered "$LOG_DIR/17a-mid-status.log" "$a")
    near "$s" 30 3 || why+=" A-off-by>3pp"
    row "$n1" "-" "A=${s:-?}% (settle ${set:-?} ms, first 1 s $(kv "$l" share_first1s_pct)%; granted ${r}%)" "$e1" "$why"
  else
    row "$n1" "-" "-" "$e1" "$HV_ERR"
    hv_end
  fi

  # (b) elastic A, then B
  a=e2e-c17b-a
  local b=e2e-c17b-b goa=$WORK/go-17b-A gob=$WORK/go-17b-B
  cfg=$WORK/hv-17b.toml
  why=""
  {
    hv_pod "$a" 'weight = 1' 'share = 30' 'policy = "elastic"'
    hv_pod "$b" "weight = $HV_B_WEIGHT" 'policy = "fixed"'
  } | hv_config "$cfg"
  clean_shm
  rm -f "$goa" "$gob"
  if ! hv_start 17b "$cfg"; then
    row "$n2" "-" "-" "$e2" "$HV_ERR"
    hv_end
    return
  fi
  why+=$(hv_placed 17b-start "$a" "$b")
  local la=$LOG_DIR/17b-A.log lb=$LOG_DIR/17b-B.log pa pb tb
  hv_spin 17b-A "$a" 5.3 "$goa"
  pa=$HS_PID
  hv_spin 17b-B "$b" 3 "$gob"
  pb=$HS_PID
  hv_wait_ready "$la" "$lb" || why+=" not-ready"
  hv_go "$goa"
  sleep_until 1.5
  hv_status 17b-alone
  sleep_until 2.0
  touch "$gob"
  tb=$(now_t)
  sleep_until 3.5
  hv_status 17b-contended
  wait "$pa"
  wait "$pb"
  hv_end
  local an=$LOG_DIR/17b-analysis.log
  hv_analyse "$an" --origin f0 --win alone:0.5:2.0 --win contended:s1+1:end \
    --series around:s1-0.5:s1+1.5 --settle ret:0:s1:end:"$target":3 \
    "$WORK/17b-A.intervals" "$WORK/17b-B.intervals"
  local alone cont bcont bs ret rets ra1 ra2 rb2
  alone=$(kv "$an" win_alone_f0_pct) cont=$(kv "$an" win_contended_f0_pct) bcont=$(kv "$an" win_contended_f1_pct)
  bs=$(kv "$an" f1_first_s) ret=$(kv "$an" settle_ret_ms) rets=$(kv "$an" settle_ret_sliding_ms)
  ra1=$(pct_from_ppm "$(kv "$LOG_DIR/17b-alone-status.log" "pod_${a}_rate_ppm")")
  ra2=$(pct_from_ppm "$(kv "$LOG_DIR/17b-contended-status.log" "pod_${a}_rate_ppm")")
  rb2=$(pct_from_ppm "$(kv "$LOG_DIR/17b-contended-status.log" "pod_${b}_rate_ppm")")
  say "   17b: B released at t=${tb} s, B's first kernel ${bs:-?} s after A's first"
  say "   17b: 100 ms series from B start - 0.5 s (per-mille), A: $(kv "$an" series_around_f0_pm)"
  say "   17b:                                              B: $(kv "$an" series_around_f1_pm)"
  say "   17b: A back within ${target}+-3pp: ${ret:-?} ms after B's start (100 ms windows; 500 ms sliding average: ${rets:-?} ms; -1 = never)"
  why+="$(spin_why "$la" A)$(spin_why "$lb" B)"
  why+=$(hv_registered "$LOG_DIR/17b-contended-status.log" "$a" "$b")
  [[ $(kv "$an" ok) == 1 ]] || why+=" analysis-failed"
  fok 'a >= 90' "$alone" || why+=" A-alone<90%"
  near "$cont" "$target" 3 || why+=" A-contended-off-by>3pp"
  row "$n2" "-" \
    "A alone=${alone:-?}%; contended A=${cont:-?}% B=${bcont:-?}%; A back in ${ret:-?} ms (sliding ${rets:-?} ms); granted A alone=${ra1}%, contended A=${ra2}% B=${rb2}%" \
    "$e2" "$why"
}

# 18: suspend and resume through the admin API
check_hv_suspend() {
  local a=e2e-c18-a
  local name="18. hypervisor suspend/resume: pod A cap = 50, policy fixed, alone, spin 2000us runtime 5 s; suspend at t=1.5 s, resume at t=3.5 s"
  local exp="busy [1.7 s, 3.4 s] <= 3%; from 3.7 s 50+-3%; exit 0, kernels = launches"
  hv_prereq || { row "$name" "-" "-" "$exp" "$HV_WHY"; return; }
  local cfg=$WORK/hv-18.toml go=$WORK/go-18 why=""
  hv_pod "$a" 'cap = 50' 'policy = "fixed"' | hv_config "$cfg"
  clean_shm
  rm -f "$go"
  if ! hv_start 18 "$cfg"; then
    row "$name" "-" "-" "$exp" "$HV_ERR"
    hv_end
    return
  fi
  why+=$(hv_placed 18-start "$a")
  local l=$LOG_DIR/18-A.log p ls=$LOG_DIR/18-suspend.log lr=$LOG_DIR/18-resume.log
  hv_spin 18-A "$a" 5 "$go"
  p=$HS_PID
  hv_wait_ready "$l" || why+=" not-ready"
  hv_go "$go"
  # the helper starts early and sends at the exact time
  sleep_until 1.0
  hvctl "$HV_URL" admin "$HV_ADMIN" suspend "$a" "$(t_abs 1.5)" >"$ls"
  sleep_until 2.5
  hv_status 18-suspended
  sleep_until 3.0
  hvctl "$HV_URL" admin "$HV_ADMIN" resume "$a" "$(t_abs 3.5)" >"$lr"
  sleep_until 4.3
  hv_status 18-resumed
  wait "$p"
  hv_end
  local an=$LOG_DIR/18-analysis.log
  hv_analyse "$an" --origin f0 --ref-epoch "$T_GO" --win before:1.0:1.5 --win suspended:1.7:3.4 \
    --win after:3.7:e0 --series all:0:e0 --gap off:0:0.5:e0 "$WORK/18-A.intervals"
  local ts tr bb bs ba gs ge kn ln ss
  ts=$(since "$(kv "$ls" at_epoch)") tr=$(since "$(kv "$lr" at_epoch)")
  bb=$(kv "$an" win_before_f0_pct) bs=$(kv "$an" win_suspended_f0_pct) ba=$(kv "$an" win_after_f0_pct)
  gs=$(kv "$an" gap_off_start_s) ge=$(kv "$an" gap_off_end_s)
  kn=$(kv "$l" kernels) ln=$(kv "$l" launches)
  ss=$(kv "$LOG_DIR/18-suspended-status.log" "pod_${a}_suspended")
  say "   18: suspend sent at t=$(since "$(kv "$ls" sent_epoch)") s, answered at t=${ts} s (HTTP $(kv "$ls" http_status): $(kv "$ls" answer))"
  say "   18: resume sent at t=$(since "$(kv "$lr" sent_epoch)") s, answered at t=${tr} s (HTTP $(kv "$lr" http_status): $(kv "$lr" answer))"
  say "   18: longest idle stretch ${gs:-?}..${ge:-?} s; first kernel $(kv "$an" origin_minus_ref_ms) ms after go (if %globaltimer follows the host clock)"
  say "   18: 100 ms series (per-mille): $(kv "$an" series_all_f0_pm)"
  why+=$(spin_why "$l" A)
  why+=$(hv_registered "$LOG_DIR/18-suspended-status.log" "$a")
  local mst mso
  mst=$(kv "$l" max_stall_us) mso=$(kv "$l" stalls_over_1ms)
  say "   18: launch stalls: max ${mst:-?} us, ${mso:-?} over 1 ms"
  [[ $(kv "$ls" ok) == 1 ]] || why+=" suspend-HTTP-$(kv "$ls" http_status)"
  [[ $(kv "$lr" ok) == 1 ]] || why+=" resume-HTTP-$(kv "$lr" http_status)"
  [[ $ss == 1 ]] || why+=" status-not-suspended"
  [[ $(kv "$an" ok) == 1 ]] || why+=" analysis-failed"
  fok 'a <= 3' "$bs" || why+=" busy-while-suspended>3%"
  near "$ba" 50 3 || why+=" after-resume-off-by>3pp"
  { isnum "$kn" && [[ $kn == "$ln" ]]; } || why+=" kernels!=launches"
  row "$name" "-" \
    "before=${bb:-?}% suspended=${bs:-?}% after=${ba:-?}%; idle ${gs:-?}..${ge:-?} s; calls at t=${ts}/${tr} s; kernels=${kn:-?} launches=${ln:-?}" \
    "$exp" "$why"
}

# 19: the daemon killed and started again while two pods run
check_hv_restart() {
  local a=e2e-c19-a b=e2e-c19-b
  local name="19. hypervisor kill -9 at t=2 s, restart at t=4 s: pods A and B (weight 1 each, policy fixed), spin 2000us runtime 6 s each"
  local exp="both exit 0; each pod's busy in [2.2 s, 3.8 s] = its last granted share +-5pp; workers of both pods listed again by t=5.5 s"
  hv_prereq || { row "$name" "-" "-" "$exp" "$HV_WHY"; return; }
  local cfg=$WORK/hv-19.toml go=$WORK/go-19 why=""
  {
    hv_pod "$a" 'weight = 1' 'policy = "fixed"'
    hv_pod "$b" 'weight = 1' 'policy = "fixed"'
  } | hv_config "$cfg"
  clean_shm
  rm -f "$go"
  if ! hv_start 19 "$cfg"; then
    row "$name" "-" "-" "$exp" "$HV_ERR"
    hv_end
    return
  fi
  why+=$(hv_placed 19-start "$a" "$b")
  local la=$LOG_DIR/19-A.log lb=$LOG_DIR/19-B.log pa pb
  hv_spin 19-A "$a" 6 "$go"
  pa=$HS_PID
  hv_spin 19-B "$b" 6 "$go"
  pb=$HS_PID
  hv_wait_ready "$la" "$lb" || why+=" not-ready"
  hv_go "$go"
  sleep_until 1.8
  hv_status 19-prekill
  sleep_until 2.0
  local old=$HV_PID tk tu="" tw="" lw=$LOG_DIR/19-workers.log
  kill -KILL "$old" 2>/dev/null
  tk=$(now_t)
  { wait "$old"; } 2>/dev/null # without bash's "Killed" notice
  echo "# killed with SIGKILL at t=$tk s" >>"$HV_LOGFILE"
  HV_PID=""
  sleep_until 4.0
  if hv_start 19 "$cfg" "$HV_PORT"; then
    tu=$(now_t)
    HVCTL_T=10 hvctl "$HV_URL" wait-workers "$(t_abs 6.5)" "$a" "$b" >"$lw"
    tw=$(since "$(kv "$lw" seen_epoch)")
    hv_status 19-restarted
  else
    why+=" restart-failed"
  fi
  wait "$pa"
  wait "$pb"
  hv_end
  local an=$LOG_DIR/19-analysis.log st=$LOG_DIR/19-prekill-status.log
  hv_analyse "$an" --origin first --win pre:1.0:2.0 --win outage:2.2:3.8 --win post:4.5:end \
    --series all:0:end "$WORK/19-A.intervals" "$WORK/19-B.intervals"
  local ga gb oa ob pra prb poa pob
  ga=$(pct_from_ppm "$(kv "$st" "pod_${a}_rate_ppm")") gb=$(pct_from_ppm "$(kv "$st" "pod_${b}_rate_ppm")")
  oa=$(kv "$an" win_outage_f0_pct) ob=$(kv "$an" win_outage_f1_pct)
  pra=$(kv "$an" win_pre_f0_pct) prb=$(kv "$an" win_pre_f1_pct)
  poa=$(kv "$an" win_post_f0_pct) pob=$(kv "$an" win_post_f1_pct)
  say "   19: killed at t=${tk} s, status answering again at t=${tu:-?} s, workers of both pods listed at t=${tw:-?} s ($(kv "$lw" workers_adopted) adopted)"
  say "   19: A 100 ms series (per-mille): $(kv "$an" series_all_f0_pm)"
  say "   19: B 100 ms series (per-mille): $(kv "$an" series_all_f1_pm)"
  local msa msb
  msa=$(kv "$la" max_stall_us) msb=$(kv "$lb" max_stall_us)
  say "   19: launch stalls: A max ${msa:-?} us, B max ${msb:-?} us"
  why+="$(spin_why "$la" A)$(spin_why "$lb" B)"
  why+=$(hv_registered "$st" "$a" "$b")
  [[ $(kv "$an" ok) == 1 ]] || why+=" analysis-failed"
  if [[ $ga == "?" || $gb == "?" ]]; then
    why+=" no-granted-share-before-the-kill"
  else
    near "$oa" "$ga" 5 || why+=" A-outage-off-by>5pp"
    near "$ob" "$gb" 5 || why+=" B-outage-off-by>5pp"
  fi
  [[ $(kv "$lw" ok) == 1 ]] || why+=" workers-not-listed-again"
  fok 'a <= 5.5' "$tw" || why+=" re-registration-after-5.5s"
  row "$name" "-" \
    "granted A=${ga}% B=${gb}%; outage A=${oa:-?}% B=${ob:-?}% (before A=${pra:-?}% B=${prb:-?}%, after restart A=${poa:-?}% B=${pob:-?}%); workers back at t=${tw:-?} s" \
    "$exp" "$why"
}

# 20: the hypervisor's own admission-latency test, on loopback (no GPU)
check_hv_latency() {
  local name="20. hypervisor admission latency (tests/latency.rs: 100 workers of 4 pods, loopback, client side)"
  local exp="p50 <= 200us, p99 <= 2ms"
  if [[ -z $HVLAT ]]; then
    row "$name" "-" "no hypervisor-latency-test in the bundle" "$exp" INFO
    return
  fi
  local log=$LOG_DIR/20-latency.log pl=$LOG_DIR/20-latency-parsed.log why=""
  clean_shm
  {
    echo "# $HVLAT --nocapture --test-threads 1"
    (cd "$WORK" && timeout -k 5 300 env -u LD_PRELOAD "$HVLAT" --nocapture --test-threads 1)
    echo "# exit=$?"
  } >"$log" 2>&1
  clean_shm
  hvctl - latency "$log" >"$pl"
  local p50 p99 e mx sp50 sp99 h50 c99 bld
  p50=$(kv "$pl" p50_us) p99=$(kv "$pl" p99_us) e=$(exitof "$log")
  mx=$(kv "$pl" max_us) sp50=$(kv "$pl" server_p50_us) sp99=$(kv "$pl" server_p99_us)
  h50=$(kv "$pl" healthz_p50_us) c99=$(kv "$pl" concurrent_p99_us) bld=$(kv "$pl" build)
  [[ $e == 0 ]] || why+=" test-exit=$e"
  [[ $(kv "$pl" ok) == 1 ]] || why+=" no-latency-line"
  fok 'a <= 200' "$p50" || why+=" p50>200us"
  fok 'a <= 2000' "$p99" || why+=" p99>2ms"
  row "$name" "-" \
    "p50=${p50:-?}us p99=${p99:-?}us max=${mx:-?}us; server side p50<=${sp50:-?}us p99<=${sp99:-?}us; GET /healthz p50=${h50:-?}us; 4 concurrent clients p99=${c99:-?}us; ${bld:-?} build" \
    "$exp" "$why"
}

# ------------------------------------------------------------------ report --

# 21: reports right after a process holding 3 GiB ended
# stale_sequence MODE TAG HOW(exit|kill) -> ST_A ST_A0 ST_T ST_F ST_SMI
stale_sequence() {
  local mode=$1 tag=$2 how=$3 pod=e2e-stale-$3
  local flag=$WORK/release-21-$tag-$how alog=$LOG_DIR/21-$tag-$how-A.log
  local blog=$LOG_DIR/21-$tag-$how-B.log slog=$LOG_DIR/21-$tag-$how-smi.log
  rm -f "$flag"
  clean_shm
  env_for "$mode" "$pod"
  echo "# mode=$mode pod=$pod (A holds 3 GiB, then $how) start $(date +%T.%N)" >"$alog"
  "${ENVCMD[@]}" "$BIN/mem_hold" $((3 * GiB)) "$flag" 120 keep >>"$alog" 2>&1 &
  local apid=$! i
  BG_PIDS+=("$apid")
  for ((i = 0; i < 600; i++)); do
    grep -q '^holding=1' "$alog" 2>/dev/null && break
    grep -q '^alloc_rc=' "$alog" 2>/dev/null && ! grep -q '^alloc_rc=0' "$alog" && break
    kill -0 "$apid" 2>/dev/null || break
    sleep 0.1
  done
  ST_A=$(kv "$alog" alloc_rc) ST_A0=$(kv "$alog" free0)
  if [[ $how == kill ]]; then kill -9 "$apid" 2>/dev/null; else touch "$flag"; fi
  wait "$apid" 2>/dev/null
  echo "# A ended ($how) at $(date +%T.%N)" >>"$alog"
  # at once: the next process of the pod, then nvidia-smi in the pod
  run_prog "$mode" "$pod" "$blog" 60 "$BIN/mem_hold" 0
  ST_T=$(kv "$blog" total0) ST_F=$(kv "$blog" free0)
  run_prog "$mode" "$pod" "$slog" 60 nvidia-smi -i 0 --query-gpu=memory.total,memory.used,memory.free --format=csv,noheader,nounits
  ST_SMI=$(grep -a -m1 -E '^[[:space:]]*[0-9]+[[:space:]]*,' "$slog" | tr -d ' ')
}

check_stale() {
  local how
  for how in exit kill; do
    local name="21. report right after a 3GiB holder ends ($how)"
    [[ $how == kill ]] && name="21. report right after a 3GiB holder ends (SIGKILL)"
    local exp="with: A=0, next: total=4096MiB free>=3072MiB, nvidia-smi total=4096 used<=512; without: free back within 1GiB"
    if ! built mem_hold; then
      row "$name" "not built" "not built" "$exp" "build failed"
      continue
    fi
    stale_sequence base base "$how"
    local bA=$ST_A bA0=$ST_A0 bF=$ST_F bS=$ST_SMI
    stale_sequence lim lim "$how"
    local lA=$ST_A lT=$ST_T lF=$ST_F lS=$ST_SMI lst lsu why=""
    IFS=, read -r lst lsu _ <<<"$lS"
    why+="$(exit_why "$LOG_DIR/21-base-$how-B.log" base-next)$(exit_why "$LOG_DIR/21-lim-$how-B.log" lim-next)"
    [[ $bA == 0 ]] || why+=" base-A!=0"
    isnum "$bF" && isnum "$bA0" && (((bF + GiB) >= bA0)) || why+=" base-free-not-back"
    [[ $lA == 0 ]] || why+=" A!=0"
    ncmp "$lT" eq $QUOTA || why+=" total!=quota"
    ncmp "$lF" ge $((3 * GiB)) || why+=" free<3072MiB"
    ncmp "$lst" eq $QUOTA_MIB || why+=" smi-total!=4096"
    ncmp "$lsu" le 512 || why+=" smi-used>512"
    row "$name" "A=${bA:-?} before=$(mibs "$bA0") next-free=$(mibs "$bF") smi=${bS:-?}" \
      "A=${lA:-?} next: total=$(mibs "$lT") free=$(mibs "$lF") smi=${lS:-?}" "$exp" "$why"
  done
  clean_shm
}

# 22: the hypervisor is down and never granted limits
HV_DOWN_URL=""

check_hv_down() {
  local port
  port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' 2>/dev/null)
  HV_DOWN_URL=http://127.0.0.1:${port:-9}
  say "   hypervisor-down URL: $HV_DOWN_URL"
  local name="22a. hypervisor down + local 4g: cudaMalloc until OOM"
  local exp="with: total=4096MiB, 2GiB<=got<=4GiB, err=2, 1 stderr line 'local limits apply'; without: got>8GiB"
  if built mem_runtime; then
    local b=$LOG_DIR/22a-base.log l=$LOG_DIR/22a-down.log why lines
    clean_shm
    run_prog base - "$b" 180 "$BIN/mem_runtime"
    clean_shm
    run_prog down:4g e2e-down-local "$l" 180 "$BIN/mem_runtime"
    local bo lt lo lf
    bo=$(kv "$b" obtained) lt=$(kv "$l" total0) lo=$(kv "$l" obtained) lf=$(kv "$l" fail_code)
    lines=$(grep -a -c '^cuda-limiter:' "$l")
    why="$(exit_why "$b" base)$(exit_why "$l" down)"
    ncmp "$bo" gt $((8 * GiB)) || why+=" base-got<=8GiB"
    ncmp "$lt" eq $QUOTA || why+=" total!=quota"
    ncmp "$lo" le $QUOTA || why+=" got>quota"
    ncmp "$lo" ge $((2 * GiB)) || why+=" got<2GiB"
    ncmp "$lf" eq 2 || why+=" err!=2"
    [[ $lines == 1 ]] && grep -a -q '^cuda-limiter:.*the local limits apply' "$l" || why+=" stderr-lines=$lines"
    row "$name" "got=$(gib "$bo")" "total=$(mibs "$lt") got=$(gib "$lo") err=${lf:-?} lines=$lines" "$exp" "$why"
  else
    row "$name" "not built" "not built" "$exp" "build failed"
  fi
  name="22b. hypervisor down, no local limit: CUDA refused"
  exp="with: cudaMalloc(1GiB)!=0, exactly 1 stderr line 'CUDA refuses to initialise'; without: cudaMalloc=0"
  if built mem_hold; then
    local b=$LOG_DIR/22b-base.log l=$LOG_DIR/22b-down.log why lines
    clean_shm
    run_prog base - "$b" 60 "$BIN/mem_hold" "$GiB"
    clean_shm
    run_prog down: e2e-down-none "$l" 60 "$BIN/mem_hold" "$GiB"
    local ba la
    ba=$(kv "$b" alloc_rc) la=$(kv "$l" alloc_rc)
    lines=$(grep -a -c '^cuda-limiter:' "$l")
    why="$(exit_why "$b" base)"
    [[ $ba == 0 ]] || why+=" base-alloc!=0"
    isnum "$la" && ((la != 0)) || why+=" alloc-not-refused"
    [[ $lines == 1 ]] && grep -a -q '^cuda-limiter:.*CUDA refuses to initialise' "$l" || why+=" stderr-lines=$lines"
    row "$name" "alloc=${ba:-?}" "alloc=${la:-?} ($(kv "$l" alloc_name)) lines=$lines" "$exp" "$why"
  else
    row "$name" "not built" "not built" "$exp" "build failed"
  fi
  clean_shm
}

finish() {
  local table=$RES/table.md
  {
    echo "| check | without limiter | with limiter | expected | result |"
    echo "| --- | --- | --- | --- | --- |"
    printf '%s\n' "${ROWS[@]}"
    echo
    echo "$PASSED passed, $FAILED failed"
  } >"$table"
  local f
  {
    cat "$PROGRESS"
    for f in "$LOG_DIR"/*; do
      [[ -f $f ]] || continue
      echo
      echo "===================== $(basename "$f") ($(wc -l <"$f") lines)"
      if (($(wc -l <"$f") > 3000)); then
        head -n 1500 "$f"
        echo "[... cut ...]"
        tail -n 1500 "$f"
      else
        cat "$f"
      fi
    done
    echo
    echo "===================== table"
    cat "$table"
  } >"$RES/e2e.log" 2>&1
  tar -C "$WORK" -czf "$RES/e2e-logs.tar.gz" e2e-logs 2>/dev/null
  echo
  echo "logs: $LOG_DIR  combined: $RES/e2e.log  table: $table  ($(($(date +%s) - T_START)) s)"
  echo
  cat "$table"
}

step() { # NUM FUNCTION ARGS...
  local num=$1
  shift
  want "$num" || return 0
  local t0
  t0=$(date +%s)
  say "== check $num: $* ($(date +%T))"
  "$@"
  say "   check $num took $(($(date +%s) - t0)) s"
}

NVCC=$(find_nvcc)
preflight
build_all
clean_shm
step 1 check_runtime 1 "static cudart" mem_runtime e2e-rt-static
step 2 check_runtime 2 "shared cudart" mem_runtime_shared e2e-rt-shared
step 3 check_ctypes
step 4 check_apis
step 5 check_torch
step 6 check_smi
step 7 check_pods
step 8 check_pairs
step 9 check_bench
step 10 check_spawn
step 11 check_share
step 12 check_series
step 13 check_torch_share
step 14 check_launch
step 15 check_pod_share
if want 16 || want 17 || want 18 || want 19 || want 20; then hv_prepare; fi
step 16 check_hv_weighted
step 17 check_hv_caps
step 18 check_hv_suspend
step 19 check_hv_restart
step 20 check_hv_latency
hv_stop
step 21 check_stale
step 22 check_hv_down
clean_shm
finish
((FAILED == 0 && PASSED > 0)) && exit 0
exit 1
