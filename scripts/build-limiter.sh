#!/usr/bin/env bash
# Builds the shipped limiter (release) against an old glibc, so that it loads
# in every common workload image: it is preloaded into every process of a
# container, and a library the loader cannot load (a GLIBC_x.y symbol version
# the image's glibc lacks) stops them all from starting. cargo-zigbuild links
# with zig against the glibc named in the target triple's suffix.
#   scripts/build-limiter.sh [cargo args, e.g. --features launch-ab]
# Prints the path of the .so on its last line. Needs cargo-zigbuild and zig
# (the cargo-zigbuild and ziglang wheels of scripts/packaging-requirements.txt). TARGET_DIR: default target/glibc-baseline.
set -euo pipefail
cd "$(dirname "$0")/.."
# Kept in step with scripts/check-glibc.py's default: the newest GLIBC_x.y
# symbol version the library may need. 2.17: CentOS 7 and every newer image
# (UBI 8 and Rocky 8 have 2.28, Ubuntu 20.04 2.31).
GLIBC_BASELINE=2.17
target_dir=${TARGET_DIR:-target/glibc-baseline}
if ! command -v cargo-zigbuild >/dev/null 2>&1; then
  echo "build-limiter: cargo-zigbuild is not installed (python3 -m pip install -r scripts/packaging-requirements.txt)" >&2
  exit 2
fi
if ! command -v zig >/dev/null 2>&1 && ! python3 -m ziglang version >/dev/null 2>&1; then
  echo "build-limiter: zig is not installed (python3 -m pip install -r scripts/packaging-requirements.txt)" >&2
  exit 2
fi
cargo zigbuild --release --locked -p cuda-limiter \
  --target "x86_64-unknown-linux-gnu.$GLIBC_BASELINE" --target-dir "$target_dir" "$@" >&2
echo "$target_dir/x86_64-unknown-linux-gnu/release/libcuda_limiter.so"
