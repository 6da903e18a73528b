#!/usr/bin/env bash
# quota.c under a 2 GiB memory quota and 30% of the GPU's time, in local
# mode: no daemon, the limits are the process's environment.
#
#   examples/local-quota/run.sh
#
# Builds the limiter (release) and the program, then runs the program with
# the limiter preloaded. With an NVIDIA driver on the machine the program
# uses it; without one, the workspace's driver double (a fake 16 GiB GPU).
# LIMITER=path/libcuda_limiter.so uses a limiter already built;
# GPUSHARE_DOUBLE_DIR=dir uses the driver double built there.
set -euo pipefail
cd "$(dirname "$0")/../.."
build=$(mktemp -d)
pod=${CUDA_LIMITER_POD:-quota-example-$$}
# In local mode the pod's ledger outlives its processes: remove it at the end.
trap 'rm -rf "$build"; rm -f "/dev/shm/gpushare-pod-$pod"' EXIT

if [[ -z ${LIMITER:-} ]]; then
  cargo build --release --locked -p cuda-limiter >&2
  LIMITER=$PWD/target/release/libcuda_limiter.so
fi
if [[ -z ${GPUSHARE_DOUBLE_DIR:-} ]] && ! ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 '; then
  cargo build --release --locked -p gpushare-examples >&2
  GPUSHARE_DOUBLE_DIR=$(ls -d target/release/build/gpushare-examples-*/out/double | head -n 1)
fi
if [[ -n ${GPUSHARE_DOUBLE_DIR:-} ]]; then
  echo "driver: the workspace's double"
  export LD_LIBRARY_PATH="$GPUSHARE_DOUBLE_DIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
  echo "driver: the system's libcuda.so.1"
fi

"${CC:-cc}" -O2 -Wall -Wextra -o "$build/quota" examples/local-quota/quota.c -ldl

LD_PRELOAD="$LIMITER" \
  CUDA_DEVICE_MEMORY_LIMIT=2g \
  CUDA_DEVICE_SM_LIMIT=30 \
  CUDA_LIMITER_POD="$pod" \
  "$build/quota"
