#!/usr/bin/env bash
# Where the limiter's launch cost goes, on the GPU machine (the 20 µs
# cadence row, taken apart). From the repository root:
#
#   bash scripts/bench/launch_cost.sh [--seconds S] LIMITER.so...
#     the paced loop (20 µs of host work, one empty launch) in 4 consecutive
#     windows of 6,000 iterations per process (`compute_bench pace 20 6000 4`),
#     one process
#     without a limiter and one per LIMITER.so (CUDA_DEVICE_SM_LIMIT=50, which
#     does not bind) in rotating order until S seconds (default 300) passed;
#     prints each arm's per-window medians and change against no limiter.
#     Pass limiters built with a part of the launch path cut out to see what
#     that part costs; the windows show whether a process speeds up as it
#     runs (without a limiter it does, by ~2% of the launch call).
#   bash scripts/bench/launch_cost.sh --mimic [--seconds S]
#     the limiter's sample mimicked in an unlimited process (`compute_bench
#     mimic 6000 2`):
#     each mode's iteration and launch call against the plain windows of the
#     same process, in its first round and in its second.
#
# Every process is pinned like compute_bench's runs. Raw lines go to
# $OUT/launch-cost.txt when OUT is set. NVCC overrides the compiler.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
seconds=300
mimic=0
limiters=()
while [ $# -gt 0 ]; do
  case $1 in
    --seconds) seconds=$2; shift 2 ;;
    --mimic) mimic=1; shift ;;
    *) limiters+=("$(realpath "$1")"); shift ;;
  esac
done
if [ $mimic = 0 ] && [ ${#limiters[@]} = 0 ]; then
  echo "usage: launch_cost.sh [--seconds S] LIMITER.so... | --mimic [--seconds S]" >&2
  exit 2
fi
cpus=$(cd "$here" && python3 -c "import compute_bench as c; print(c.gpu_local_cpus())")
build=$(mktemp -d /tmp/launch-cost.XXXXXX)
trap 'rm -rf "$build"' EXIT
raw=$build/raw.txt
${NVCC:-nvcc} -O2 -arch=native -o "$build/compute_bench" "$here/compute_bench.cu" -ldl
end=$((SECONDS + seconds))
if [ $mimic = 1 ]; then
  while [ $SECONDS -lt $end ]; do taskset -c "$cpus" "$build/compute_bench" mimic 6000 2; done > "$raw"
else
  arms=(none "${limiters[@]}")
  round=0
  while [ $SECONDS -lt $end ]; do
    for ((i = 0; i < ${#arms[@]}; i++)); do
      arm=${arms[$(((round + i) % ${#arms[@]}))]}
      if [ "$arm" = none ]; then
        echo "none $(taskset -c "$cpus" "$build/compute_bench" pace 20 6000 4)"
      else
        pod=launch-cost-$$
        echo "$(basename "$arm") $(LD_PRELOAD=$arm CUDA_DEVICE_SM_LIMIT=50 CUDA_LIMITER_POD=$pod \
          taskset -c "$cpus" "$build/compute_bench" pace 20 6000 4)"
        rm -f "/dev/shm/gpushare-pod-$pod"
      fi
    done
    round=$((round + 1))
  done > "$raw"
fi
[ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp "$raw" "$OUT/launch-cost.txt"
python3 - "$raw" "$mimic" <<'PY'
import collections, re, statistics as st, sys

lines = open(sys.argv[1]).read().splitlines()
med = st.median
if sys.argv[2] == "1":
    names = {1: "sample, read by a monitor thread", 2: "sample, read by the launching thread",
             3: "sample without the stream query", 4: "sample, events without timing"}
    rows = []
    for line in lines:
        got = {(int(r), int(m)): (float(i), float(c))
               for r, m, i, c in re.findall(r"r(\d)m(\d)=([\d.]+)/([\d.]+)", line)}
        if len(got) == 10:
            rows.append(got)
    print(f"{len(rows)} processes; each mode against the plain window of the same round")
    for r in range(2):
        for m in range(1, 5):
            it = med(x[(r, m)][0] / x[(r, 0)][0] - 1 for x in rows) * 100
            call = med(x[(r, m)][1] - x[(r, 0)][1] for x in rows)
            print(f"round {r} mode {m} ({names[m]}): iteration {it:+.2f}%, launch call {call:+.0f} ns")
    sys.exit()
arms = collections.defaultdict(list)
for line in lines:
    it = [float(x) for x in re.findall(r"iter\d=([\d.]+)", line)]
    call = [float(x) for x in re.findall(r"call\d=([\d.]+)", line)]
    if len(it) == 4 and len(call) == 4:
        arms[line.split()[0]].append((it, call))
base = arms.pop("none", [])
if not base:
    sys.exit("no run without a limiter completed")
def show(name, runs):
    its = [med(r[0][w] for r in runs) for w in range(4)]
    calls = [med(r[1][w] for r in runs) for w in range(4)]
    return its, calls, f"{name} ({len(runs)} processes): ns per iteration " + " / ".join(f"{x:.1f}" for x in its) + \
        ", launch call " + " / ".join(f"{x:.1f}" for x in calls)
b_its, b_calls, text = show("no limiter", base)
print(text)
for name, runs in arms.items():
    its, calls, text = show(name, runs)
    print(text)
    print("  against no limiter, by window: " + " / ".join(
        f"{(i / b - 1) * 100:+.2f}% ({c - bc:+.0f} ns)" for i, b, c, bc in zip(its, b_its, calls, b_calls)))
PY
