#!/usr/bin/env bash
# train_step.py and infer_loop.py at the same time, as the pods "train" and
# "infer" of the node daemon (hypervisor.toml); needs a GPU and PyTorch.
#
#   examples/pytorch/run.sh
#
# Builds the limiter and the daemon (release), makes the pods' tokens and a
# copy of the configuration in a temporary folder, starts the daemon on a
# free loopback port, runs both programs under the limiter, prints the
# daemon's status, and stops it. LIMITER=path/libcuda_limiter.so and
# HYPERVISOR=path/hypervisor use builds already made; PYTHON picks the
# interpreter (default python3); HYPERVISOR_ARGS adds arguments to
# `hypervisor serve`.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [[ -z ${LIMITER:-} || -z ${HYPERVISOR:-} ]]; then
  (cd "$here/../.." && cargo build --release --locked -p cuda-limiter -p hypervisor >&2)
  LIMITER=${LIMITER:-$here/../../target/release/libcuda_limiter.so}
  HYPERVISOR=${HYPERVISOR:-$here/../../target/release/hypervisor}
fi
dir=$(mktemp -d)
daemon=""
cleanup() {
  if [[ -n $daemon ]]; then kill "$daemon" 2>/dev/null || true; wait "$daemon" 2>/dev/null || true; fi
  rm -rf "$dir"
  # The pods' objects stay while the daemon's configuration names them;
  # with the daemon gone they can go.
  rm -f /dev/shm/gpushare-pod-{train,infer} /dev/shm/gpushare-limits-{train,infer}
}
trap cleanup EXIT

# The configuration and its token files, readable by their owner alone.
cp "$here/hypervisor.toml" "$dir/"
mkdir "$dir/tokens"
for pod in train infer; do
  head -c 32 /dev/urandom | base64 >"$dir/tokens/$pod"
done
chmod 600 "$dir"/tokens/*
"$HYPERVISOR" check-config --config "$dir/hypervisor.toml"

# Port 0: the daemon picks a free port and says which on its first line.
# shellcheck disable=SC2086 # HYPERVISOR_ARGS is a list of arguments
"$HYPERVISOR" serve --config "$dir/hypervisor.toml" --listen 127.0.0.1:0 ${HYPERVISOR_ARGS:-} >"$dir/serve.out" &
daemon=$!
for _ in $(seq 100); do
  addr=$(sed -n 's/^hypervisor listening on //p' "$dir/serve.out")
  [[ -n $addr ]] && break
  kill -0 "$daemon" || { echo "the daemon exited" >&2; exit 1; }
  sleep 0.1
done
[[ -n $addr ]] || { echo "the daemon did not start" >&2; exit 1; }
echo "daemon: http://$addr"

limited() { # POD COMMAND...: COMMAND as a process of POD, its limits the daemon's
  local pod=$1
  shift
  LD_PRELOAD="$LIMITER" CUDA_LIMITER_HYPERVISOR="http://$addr" \
    CUDA_LIMITER_POD="$pod" CUDA_LIMITER_TOKEN_FILE="$dir/tokens/$pod" "$@"
}
limited infer "${PYTHON:-python3}" "$here/infer_loop.py" &
infer=$!
limited train "${PYTHON:-python3}" "$here/train_step.py"
wait "$infer"
"$HYPERVISOR" status --addr "$addr"
