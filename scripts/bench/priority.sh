#!/usr/bin/env bash
# Priority classes on the GPU: a latency pod's inference step next
# to a batch pod, without and with classes (scripts/bench/priority_bench.py).
# On the GPU machine, from the repository root (PyTorch with CUDA installed):
#   bash scripts/bench/priority.sh gpu-bundle [--quick] [--seconds S] [--period-us P]
# gpu-bundle/ holds libcuda_limiter.so (scripts/make-gpu-bundle.sh). About
# 4 minutes (12 runs of 8 s plus start-up); results in $OUT (default
# ./priority-bench-out): priority-bench.md, .json, .log.
set -euo pipefail
bundle=${1:?usage: priority.sh BUNDLE_DIR [priority_bench.py options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
test -f "$bundle/libcuda_limiter.so" || { echo "no $bundle/libcuda_limiter.so" >&2; exit 2; }
PYTHONUNBUFFERED=1 python3 "$here/priority_bench.py" --lib "$bundle/libcuda_limiter.so" \
  --out "${OUT:-priority-bench-out}" "$@"
