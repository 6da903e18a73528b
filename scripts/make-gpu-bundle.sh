#!/usr/bin/env bash
# Builds the release artifacts and copies just those into gpu-bundle/ (git-
# ignored), small enough to carry to the GPU machine, which has no Rust; there:
#   bash scripts/gpu/run.sh gpu-bundle   (the pytest harness of scripts/gpu/e2e)
#   python3 -m scripts.bench SUBCOMMAND ...   (the benchmarks; SUBCOMMAND --help)
# With AB=1 it also builds the limiter with the `launch-ab` feature, as
# gpu-bundle/libcuda_limiter_ab.so, for `python3 -m scripts.bench launch-ab` only.
# With K8S=1 it makes gpu-bundle-k8s/ instead, for scripts/gpu/k8s_e2e.sh:
# k8s-e2e, the limiter and the official control plane the test command
# builds (scripts/build-control-plane.sh), xz-compressed to fit beside them.
# The limiter is the shipped build: linked against glibc 2.17 with
# cargo-zigbuild (scripts/build-limiter.sh), checked by scripts/check-glibc.py.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p hypervisor -p kube-fakes
limiter=$(scripts/build-limiter.sh | tail -n 1)
python3 scripts/check-glibc.py "$limiter"
if [ "${K8S:-0}" = 1 ]; then
  scripts/build-control-plane.sh
  rm -rf gpu-bundle-k8s && mkdir -p gpu-bundle-k8s
  cp "$limiter" target/release/k8s-e2e gpu-bundle-k8s/
  strip --strip-debug gpu-bundle-k8s/*
  xz -T0 -6 -c "${CARGO_TARGET_DIR:-target}/control-plane/control-plane" >gpu-bundle-k8s/control-plane.xz
  git rev-parse --short HEAD > gpu-bundle-k8s/COMMIT 2>/dev/null || true
  ls -l gpu-bundle-k8s
  exit 0
fi
rm -rf gpu-bundle && mkdir -p gpu-bundle
cp "$limiter" target/release/hypervisor target/release/k8s-e2e gpu-bundle/
# The hypervisor's admission-latency benchmark, as a standalone binary.
latency=$(cargo bench --locked -p hypervisor --bench admission_latency --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "admission_latency" and m.get("executable"):
        print(m["executable"])' | tail -n 1)
[ -n "$latency" ] && cp "$latency" gpu-bundle/hypervisor-admission-latency
if [ "${AB:-0}" = 1 ]; then
  ab=$(TARGET_DIR=target/launch-ab scripts/build-limiter.sh --features launch-ab | tail -n 1)
  cp "$ab" gpu-bundle/libcuda_limiter_ab.so
fi
strip --strip-debug gpu-bundle/*
git rev-parse --short HEAD > gpu-bundle/COMMIT 2>/dev/null || true
ls -l gpu-bundle
