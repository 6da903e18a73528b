#!/usr/bin/env bash
# Builds the CUDA side of the compute benchmarks with nvcc and runs them all,
# without and with the limiter (scripts/bench/compute_bench.py). On the GPU
# machine, from the repository root:
#   bash scripts/bench/run.sh gpu-bundle [--only shapes fixed ...] [--quick]
# gpu-bundle/ holds libcuda_limiter.so (scripts/make-gpu-bundle.sh).
set -euo pipefail
bundle=${1:?usage: run.sh BUNDLE_DIR [compute_bench.py options]}
shift
here=$(cd "$(dirname "$0")" && pwd)
build=$(mktemp -d /tmp/compute-bench.XXXXXX)
trap 'rm -rf "$build"' EXIT
nvcc -O2 -arch=native -o "$build/compute_bench" "$here/compute_bench.cu" -ldl
out=${OUT:-$build/out}
PYTHONUNBUFFERED=1 python3 "$here/compute_bench.py" --lib "$bundle/libcuda_limiter.so" \
  --bin "$build/compute_bench" --out "$out" "$@"
