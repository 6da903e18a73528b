#!/usr/bin/env bash
# The README's test command, in three timed phases:
#   1. tools: installs, once, what the tests drive besides the workspace,
#      all under target/tools/: a Python virtual environment (upstream
#      kubectl 1.37, the Python Kubernetes client, kubernetes-validate, zig,
#      cargo-zigbuild, pytest). Outside the repository it installs only
#      Debian packages the machine lacks (gcc, binutils, python3-venv);
#   2. builds: the official Kubernetes control plane from its Go modules
#      into target/control-plane/ (scripts/build-control-plane.sh; only when
#      its sources changed), in the background, beside the workspace's
#      tests: each build leaves cores idle that the other takes;
#   3. tests: every test.
# Then it prints how long each phase took and how much disk target/ takes.
# No GPU needed: the tests run against the workspace's driver double, the
# official control plane with our kubelet double, the in-process fake API
# server where a test needs what a real one cannot do on demand, and the real
# clients (kubectl, the Python client).
#   scripts/test.sh [more cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."

target=${CARGO_TARGET_DIR:-target}
tools=$target/tools
phases=()
phase_started=$SECONDS
# Ends the phase now running: records its name and length.
phase_done() {
  phases+=("$(printf '%-14s %5d s' "$1" $((SECONDS - phase_started)))")
  phase_started=$SECONDS
}
report() {
  echo "== phases"
  printf '   %s\n' "${phases[@]}"
  echo "   target/ now takes $(du -sh "$target" 2>/dev/null | cut -f1)"
}
trap report EXIT

need() { command -v "$1" >/dev/null 2>&1; }
apt_install() {
  echo "== apt-get install $* (the machine lacks them)"
  apt-get update -qq && apt-get install -y -qq "$@" >/dev/null
}

echo "== phase 1 of 3: tools, under $tools/"
if ! need cc || ! need nm; then apt_install gcc binutils; fi
# The Python tools, pinned (scripts/test-requirements.txt), in one virtual
# environment; the tests find it first on the PATH, or under target/ when
# run by plain `cargo test`.
requirements=scripts/test-requirements.txt
if ! cmp -s "$requirements" "$tools/python/installed" 2>/dev/null; then
  echo "== pip install -r $requirements (into $tools/python)"
  need python3 || apt_install python3
  rm -rf "$tools/python"
  if ! python3 -m venv "$tools/python" >/dev/null 2>&1; then
    # Debian and Ubuntu ship venv (and its pip) apart from python3.
    rm -rf "$tools/python"
    apt_install python3-venv
    python3 -m venv "$tools/python"
  fi
  "$tools/python/bin/python3" -m pip install -q --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$tools/python/installed"
fi
export PATH="$PWD/$tools/python/bin:$PATH"
phase_done tools

echo "== phase 2 of 3: builds: the Kubernetes control plane (lines marked [go]) beside the tests"
scripts/build-control-plane.sh > >(sed -u 's/^/   [go] /') 2>&1 &
plane=$!
trap 'kill "$plane" 2>/dev/null || true; report' EXIT
cargo test --workspace --locked --no-run "$@" 2>&1 | grep -v '^  Executable '
wait "$plane"
trap report EXIT
phase_done builds

echo "== phase 3 of 3: the tests"
cargo test --workspace --locked --no-fail-fast "$@"
phase_done tests
