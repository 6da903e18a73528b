#!/usr/bin/env bash
# Builds the release artifacts and copies just those into gpu-bundle/ (git-
# ignored), small enough to carry to the GPU machine, which has no Rust.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p cuda-limiter
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp target/release/libcuda_limiter.so gpu-bundle/
strip --strip-debug gpu-bundle/libcuda_limiter.so
git rev-parse --short HEAD > gpu-bundle/COMMIT 2>/dev/null || true
ls -l gpu-bundle
