#!/usr/bin/env bash
# The limiter on a program, in local mode: builds everything, then runs the
# same CUDA driver-API probe without and with a 4 GiB quota. On a machine with
# an NVIDIA driver the probe uses it; elsewhere, the workspace's driver double.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cuda-limiter -p gpushare-examples >&2
out=$(ls -d target/release/build/gpushare-examples-*/out | head -n 1)
limiter=$PWD/target/release/libcuda_limiter.so
probe="$out/bin/cudaprobe"
if ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 '; then
  echo "driver: the system's libcuda.so.1"
else
  echo "driver: the workspace's double (no NVIDIA driver here)"
  export LD_LIBRARY_PATH="$out/double${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
pod="demo-$$"
trap 'rm -f /dev/shm/gpushare-pod-$pod' EXIT
script=(info totalmem nvml alloc mem 3g alloc mem 2g info freeall info)
echo "== without the limiter"
"$probe" "${script[@]}"
echo "== LD_PRELOAD=libcuda_limiter.so CUDA_DEVICE_MEMORY_LIMIT=4g"
LD_PRELOAD="$limiter" CUDA_DEVICE_MEMORY_LIMIT=4g CUDA_LIMITER_POD="$pod" "$probe" "${script[@]}"
