#!/usr/bin/env bash
# The launch path's cost inside one process: the paced loop and the decode
# loop with the limiter's admission switched off and on between launches
# (pace: every other pair of launches; decode: every other pair of steps), so
# that the host's drift, which moves whole runs by more than the limiter
# costs, and the process's memory layout are the same for both arms. Needs a
# limiter built with the `launch-ab` feature (scripts/make-gpu-bundle.sh with
# AB=1: gpu-bundle/libcuda_limiter_ab.so), never a shipped one. On the GPU
# machine, from the repository root:
#   bash scripts/bench/launch_ab.sh gpu-bundle/libcuda_limiter_ab.so [PACE_S] [DECODE_S]
# runs processes of each for PACE_S (default 90) and DECODE_S (default 150)
# seconds, at L=50 (does not bind) unless LAUNCH_AB_LIMITS says otherwise, pinned like compute_bench.py's, and prints
# the medians of the per-process differences with the 95% interval of their
# mean. Raw lines go to $OUT (default: a temporary folder) as pace-ab.txt and
# decode-ab.txt. LAUNCH_AB_LIMITS (default CUDA_DEVICE_SM_LIMIT=50) sets the
# limits the processes run under (e.g. CUDA_DEVICE_MEMORY_LIMIT=40g: the
# launch path of a pod with a memory quota alone);
# GPUSHARE_LAUNCH_AB_PART=first-launch makes the switch take out only the
# check of a library's first use at a launch, not the whole admission.
set -euo pipefail
lib=$(realpath "${1:?usage: launch_ab.sh LIMITER_AB.so [PACE_S] [DECODE_S]}")
pace_s=${2:-90}
decode_s=${3:-150}
here=$(cd "$(dirname "$0")" && pwd)
build=$(mktemp -d /tmp/launch-ab.XXXXXX)
trap 'rm -rf "$build"' EXIT
out=${OUT:-$build}
mkdir -p "$out"
nvcc -O2 -arch=native -o "$build/compute_bench" "$here/compute_bench.cu" -ldl
cpus=$(cd "$here" && python3 -c 'import compute_bench; print(compute_bench.gpu_local_cpus())')

# Runs "$@" under the A/B limiter, one fresh pod per process, until $1 seconds passed.
repeat() {
  local seconds=$1 n=0 end
  shift
  end=$((SECONDS + seconds))
  while [ "$SECONDS" -lt "$end" ]; do
    n=$((n + 1))
    local pod="launch-ab-$$-$n"
    # shellcheck disable=SC2086 # the limits are words VAR=VALUE
    env LD_PRELOAD="$lib" ${LAUNCH_AB_LIMITS:-CUDA_DEVICE_SM_LIMIT=50} CUDA_LIMITER_POD="$pod" taskset -c "$cpus" "$@" || true
    rm -f "/dev/shm/gpushare-pod-$pod"
  done
}

repeat "$pace_s" "$build/compute_bench" pace-ab 20 40000 > "$out/pace-ab.txt"
repeat "$decode_s" python3 "$here/torch_workloads.py" decode-ab 8 > "$out/decode-ab.txt"

python3 - "$out/pace-ab.txt" "$out/decode-ab.txt" <<'PY'
import re
import statistics as st
import sys


def rows(path, mode):
    found = []
    for line in open(path):
        fields = dict(re.findall(r"(\S+?)=(\S+)", line))
        if fields.get("mode") == mode:
            found.append(fields)
    return found


def summary(values, digits=1):
    half = 1.96 * st.stdev(values) / len(values) ** 0.5 if len(values) > 1 else float("nan")
    return f"median {st.median(values):+.{digits}f}, mean {st.mean(values):+.{digits}f} +- {half:.{digits}f}"


pace = rows(sys.argv[1], "pace-ab")
if pace:
    call = [float(r["call_full"]) - float(r["call_bypass"]) for r in pace]
    iters = [(float(r["iter_full"]) / float(r["iter_bypass"]) - 1) * 100 for r in pace]
    bypass = st.median(float(r["call_bypass"]) for r in pace)
    print(f"pace-ab, {len(pace)} processes: launch call, full - bypass, ns: {summary(call)} "
          f"(bypass {bypass:.0f} ns); iteration, %: {summary(iters, 2)}")
    for name in ("mean", "p99", "p999"):
        diff = [float(r[f"{name}_full"]) - float(r[f"{name}_bypass"]) for r in pace]
        print(f"  launch call's {name}, full - bypass, ns: {summary(diff)}")
decode = rows(sys.argv[2], "decode-ab")
costs = [float(x) for r in decode for x in r["step_cost_pct"].split(",")]
if costs:
    print(f"decode-ab, {len(decode)} processes, {len(costs)} generations: step time, full over bypass, %: "
          f"{summary(costs, 2)}")
if not pace and not costs:
    sys.exit("no results: is the limiter built with --features launch-ab?")
PY
