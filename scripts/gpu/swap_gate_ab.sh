#!/usr/bin/env bash
# What swap's residency gate costs a pod that is never swapped, on the launch
# path, inside one process: the launch-ab bench (scripts/bench/launch.py) with
# GPUSHARE_LAUNCH_AB_PART=swap-gate, its processes a pod of a daemon (the gate
# acts only under a daemon's limits), the pod at cap 50 and a 40 GiB quota.
#   bash scripts/gpu/swap_gate_ab.sh gpu-bundle [PACE_S] [DECODE_S]
# gpu-bundle: hypervisor and libcuda_limiter_ab.so (make-gpu-bundle.sh, AB=1).
# Prints the bench's medians with their 95% intervals; raw lines in $OUT.
set -euo pipefail
BUNDLE=$(cd "${1:?usage: swap_gate_ab.sh BUNDLE [PACE_S] [DECODE_S]}" && pwd)
PACE_S=${2:-60}
DECODE_S=${3:-60}
cd "$(dirname "$0")/../.."
WORK=$(mktemp -d /tmp/swap-gate-ab.XXXXXX)
PORT=7391
POD=swap-gate-ab
cat >"$WORK/hypervisor.toml" <<TOML
listen = "127.0.0.1:$PORT"
admin_token = "admin"
[[pods]]
id = "$POD"
token = "swap-gate-ab-token"
[[pods.gpus]]
index = 0
memory = "40g"
cap = 50
TOML
# The node tables the daemon makes go with it, unless they were there.
made_tables=()
for table in gpushare-node-v2 gpushare-priority-v3; do
  [[ -e /dev/shm/$table ]] || made_tables+=("/dev/shm/$table")
done
HYPERVISOR_LOG=info "$BUNDLE/hypervisor" serve --config "$WORK/hypervisor.toml" >"$WORK/hypervisor.out" 2>"$WORK/hypervisor.log" &
DAEMON=$!
cleanup() {
  kill "$DAEMON" 2>/dev/null || true
  wait "$DAEMON" 2>/dev/null || true
  rm -f "/dev/shm/gpushare-pod-$POD" "/dev/shm/gpushare-limits-$POD" "${made_tables[@]}"
  rm -rf "$WORK"
}
trap cleanup EXIT
for _ in $(seq 50); do grep -q listening "$WORK/hypervisor.out" 2>/dev/null && break; sleep 0.1; done
export LAUNCH_AB_LIMITS="CUDA_LIMITER_POD=$POD CUDA_LIMITER_HYPERVISOR=http://127.0.0.1:$PORT CUDA_LIMITER_TOKEN=swap-gate-ab-token"
export GPUSHARE_LAUNCH_AB_PART=swap-gate
python3 -m scripts.bench launch-ab "$BUNDLE/libcuda_limiter_ab.so" "$PACE_S" "$DECODE_S" --out "${OUT:-$WORK}"
# The pod's processes registered with the daemon: the gate was in force.
python3 - "$PORT" <<'PY'
import json, sys, urllib.request
status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/api/v1/status"))
pods = {p["id"]: p for p in status["pods"]}
print("daemon pods:", sorted(pods), "workers now:", len(status["workers"]))
PY
grep -c "worker registered" "$WORK/hypervisor.log" | sed 's/^/workers registered: /' || true
