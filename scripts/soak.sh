#!/usr/bin/env bash
# Runs the README's test command several times in a row, then once more with
# every core kept busy by another process: a test that passes only on a
# quiet machine, or only now and then, shows up here. CI runs the command
# once; run this before trusting a new timing-sensitive test.
#   scripts/soak.sh [runs, default 3] [more cargo test args]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-3}
shift || true
for run in $(seq "$runs"); do
  echo "== tests, run $run of $runs"
  scripts/test.sh "$@"
done
cores=$(nproc)
if command -v stress-ng >/dev/null 2>&1; then
  stress-ng --cpu "$cores" --quiet &
else
  # Busy loops in the shell, one per core, where stress-ng is not installed.
  for _ in $(seq "$cores"); do (while :; do :; done) & done
fi
trap 'kill $(jobs -p) 2>/dev/null || true' EXIT
echo "== tests under load ($cores busy processes beside them)"
scripts/test.sh "$@"
