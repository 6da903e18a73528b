"""Co-run mode on a node of two GPUs: GPU 1 in co-run mode (MPS), GPU 0
time-sliced, PyTorch on both, processes started on the node (local mode).
Prints a PASS/FAIL table; exit status 0 when every row passes, 1 otherwise,
2 when the machine cannot run it (fewer than two GPUs, an MPS daemon
already running, no bundle).

  python3 scripts/gpu/corun_two_gpus.py --bundle gpu-bundle [--out DIR] [--skip-bench]
                                        [--mps-control PATH] [--bench-seconds S]
                                        [--bench-rounds N]

Run from the repository root (the bench is `python3 -m scripts.bench`).
Needs PyTorch with CUDA, nvidia-smi and nvidia-cuda-mps-control. About 3-5
minutes: the rows first (a minute), then the co-run bench on GPU 1 while
two time-sliced pods work on GPU 0.

Rows:
  1. a co-run client on GPU 1 started as an operator starts it (no
     CUDA_VISIBLE_DEVICES): the limiter names the MPS server's GPU, and
     torch.cuda.device_count() (NVML), CUDA and the MPS attribute agree on
     GPU 1 alone; 3 GiB fit its 4 GiB quota, 2 GiB more do not;
  2. the same with CUDA_VISIBLE_DEVICES=<GPU 1 UUID>, as provisioning gives it;
  3. a pod on GPU 0 (time-sliced, no MPS variables) while a co-run client
     works on GPU 1: not an MPS client, GPU 0 alone, its quota holds;
  4. a pod given GPU 0 and the co-run GPU 1, started as an MPS client:
     refused at CUDA start-up with the limiter's reason;
  5. the daemon's status: GPU 1's MPS daemon up, GPU 0 not in co-run mode;
  6. the co-run bench (`scripts.bench corun --gpu 1`) while GPU 0
     time-slices two limited pods: every run completes, every target passes;
  7. no MPS daemon and no shared object of these pods left behind.
The daemon and the MPS control daemon it starts are stopped on every path
(SIGTERM, then `quit` through the pipe folder, then SIGKILL).
"""
import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUOTA_GIB = 4
TAG = f"corun2-{os.getpid()}"
TABLES = {"GPUSHARE_NODE_REGION": f"gpushare-node-{TAG}",
          "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-{TAG}"}
# Pods of the daemon's config: id -> (GPU indices, class).
PODS = {f"{TAG}-corun": ([1], "batch"), f"{TAG}-sliced": ([0], "batch"),
        f"{TAG}-mixed": ([0, 1], "batch")}
TOKEN = "corun-two-gpus-token"

# The PyTorch client: one JSON line with what it saw and did.
CLIENT = r'''
import ctypes, json, os, sys, time
out = {"visible": os.environ.get("CUDA_VISIBLE_DEVICES", "unset")}
try:
    import torch
    out["count"] = torch.cuda.device_count()          # NVML-based before init
    x = torch.ones(1024, 1024, device="cuda")          # starts CUDA on device 0
    out["cuda_count"] = torch.cuda.device_count()
    out["uuid"] = "GPU-" + str(torch.cuda.get_device_properties(0).uuid).removeprefix("GPU-")
    cuda = ctypes.CDLL("libcuda.so.1")
    value, dev = ctypes.c_int(-1), ctypes.c_int(0)
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    cuda.cuDeviceGetAttribute(ctypes.byref(value), 133, dev)  # CU_DEVICE_ATTRIBUTE_MPS_ENABLED
    out["mps"] = value.value
    out["matmul"] = float((x @ x).sum().item()) == 1024.0 ** 3
    held = torch.empty(3 << 30, dtype=torch.uint8, device="cuda")
    out["3g"] = "ok"
    try:
        more = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        out["2g_more"] = "ok"
    except torch.OutOfMemoryError:
        out["2g_more"] = "oom"
    seconds = float(os.environ.get("CLIENT_SECONDS", "0"))
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        x = (x @ x) / 1024.0
        torch.cuda.synchronize()
except Exception as error:  # reported, not raised: the row decides
    out["error"] = f"{type(error).__name__}: {error}"[:400]
print(json.dumps(out), flush=True)
'''

# A time-sliced load on GPU 0 for the bench's duration.
LOAD = r'''
import time, torch
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
end = time.monotonic() + float(__import__("os").environ["LOAD_SECONDS"])
while time.monotonic() < end:
    y = x @ x
    torch.cuda.synchronize()
'''


def sh(*cmd, timeout=30):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def gpus():
    out = sh("nvidia-smi", "--query-gpu=index,uuid", "--format=csv,noheader").stdout
    return [line.split(", ")[1].strip() for line in out.splitlines() if ", " in line]


def mps_processes():
    out = sh("pgrep", "-a", "nvidia-cuda-mps").stdout
    return [l for l in out.splitlines() if l.strip() and not l.rstrip().endswith("<defunct>")]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    """`hypervisor serve` in local mode, GPU 1 in co-run mode, the pods of
    PODS; stopped (with its MPS daemon) by `stop`, on every path."""

    def __init__(self, bundle, work, control):
        self.work, self.control = work, control
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.mps_dir = work / "mps"
        text = f'listen = "127.0.0.1:{self.port}"\n'
        for pod, (indices, cls) in PODS.items():
            text += f'[[pods]]\nid = "{pod}"\ntoken = "{TOKEN}"\n'
            for index in indices:
                text += f'[[pods.gpus]]\nindex = {index}\nmemory = "{QUOTA_GIB}g"\nclass = "{cls}"\n'
        (work / "hypervisor.toml").write_text(text)
        self.log = open(work / "hypervisor.log", "w")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_LIMITER_", "CUDA_MPS_"))}
        env.pop("LD_PRELOAD", None)
        env.pop("CUDA_VISIBLE_DEVICES", None)
        env.update(TABLES)
        self.proc = subprocess.Popen(
            [str(Path(bundle) / "hypervisor"), "serve", "--config", str(work / "hypervisor.toml"),
             "--corun-gpu", "1", "--corun-dir", str(self.mps_dir), "--mps-control", control],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def get(self, path):
        with urllib.request.urlopen(self.url + path, timeout=5) as answer:
            return answer.status, answer.read().decode()

    def wait_ready(self, seconds=60):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited ({self.proc.returncode}); see {self.log.name}")
            try:
                if self.get("/readyz")[0] == 200:
                    return
            except Exception:  # not listening yet, or 503 while MPS starts
                pass
            time.sleep(0.2)
        raise RuntimeError(f"not ready in {seconds} s; see {self.log.name}")

    def status(self):
        return json.loads(self.get("/api/v1/status")[1])

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        # An MPS control daemon the daemon could not quit: quit it through
        # its pipe folder, then kill it by its pid file.
        for pipe in self.mps_dir.glob("*/pipe"):
            pid_file = pipe / "nvidia-cuda-mps-control.pid"
            if not pid_file.exists():
                continue
            env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe))
            try:
                subprocess.run([self.control], input="quit\n", text=True, env=env, timeout=10,
                               capture_output=True)
                time.sleep(1)
                os.kill(int(pid_file.read_text().strip()), signal.SIGKILL)
            except (OSError, ValueError, subprocess.TimeoutExpired):
                pass
        self.log.close()


def client_env(bundle, daemon, pod, mps, visible=None, seconds=0):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_LIMITER_", "CUDA_MPS_"))}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.update(TABLES, LD_PRELOAD=str(Path(bundle).resolve() / "libcuda_limiter.so"),
               CUDA_LIMITER_POD=pod, CUDA_LIMITER_TOKEN=TOKEN, CUDA_LIMITER_HYPERVISOR=daemon.url,
               CUDA_LIMITER_LOG="warn", CLIENT_SECONDS=str(seconds),
               # The daemon runs as this uid: its limits objects are trusted.
               CUDA_LIMITER_REGION_OWNER=str(os.geteuid()))
    if mps:
        # As provisioning gives a co-run GPU's client, less CUDA_VISIBLE_DEVICES.
        env.update(CUDA_LIMITER_MPS="required", CUDA_MPS_ACTIVE_THREAD_PERCENTAGE="80",
                   CUDA_MPS_PIPE_DIRECTORY=str(daemon.mps_dir / mps / "pipe"),
                   CUDA_MPS_CLIENT_PRIORITY="1", CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0={QUOTA_GIB << 10}M")
    if visible:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


def start_client(env):
    return subprocess.Popen([sys.executable, "-c", CLIENT], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=180):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return {"error": f"timed out after {timeout} s"}, err
    lines = [l for l in out.splitlines() if l.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"no result (exit {proc.returncode})"}
    return result, err


def same(a, b):
    return (a or "").lower().removeprefix("gpu-") == (b or "").lower().removeprefix("gpu-")


def judge_client(result, uuid, mps, visible):
    """'' when the client saw and did what it should, else why not."""
    wrong = []
    if "error" in result:
        return result["error"]
    if result.get("count") != 1 or result.get("cuda_count") != 1:
        wrong.append(f"device_count {result.get('count')} (NVML) / {result.get('cuda_count')} (CUDA), want 1")
    if not same(result.get("uuid"), uuid):
        wrong.append(f"device 0 is {result.get('uuid')}, want {uuid}")
    if result.get("mps") != mps:
        wrong.append(f"MPS attribute {result.get('mps')}, want {mps}")
    if not same(result.get("visible"), visible):
        wrong.append(f"CUDA_VISIBLE_DEVICES {result.get('visible')}, want {visible}")
    if not result.get("matmul"):
        wrong.append("matmul wrong")
    if (result.get("3g"), result.get("2g_more")) != ("ok", "oom"):
        wrong.append(f"quota: 3 GiB {result.get('3g')}, 2 GiB more {result.get('2g_more')}")
    return "; ".join(wrong)


def limiter_line(err):
    return next((l for l in err.splitlines() if l.startswith("cuda-limiter:")), err.strip()[-200:])


def run_rows(args, bundle, work, control, gpu0, gpu1, rows):
    daemon = Daemon(bundle, work, control)
    try:
        daemon.wait_ready()
        corun, sliced, mixed = PODS
        # 1. local mode: nothing names the GPU; the limiter must.
        result, err = finish(start_client(client_env(bundle, daemon, corun, gpu1)))
        why = judge_client(result, gpu1, 1, gpu1)
        rows.append(("GPU 1 co-run client, CUDA_VISIBLE_DEVICES unset", not why,
                     why or f"NVML 1, CUDA 1 = {gpu1[:12]}…, MPS on, quota held"))
        # 2. as provisioned.
        result, err = finish(start_client(client_env(bundle, daemon, corun, gpu1, visible=gpu1)))
        why = judge_client(result, gpu1, 1, gpu1)
        rows.append(("GPU 1 co-run client, CUDA_VISIBLE_DEVICES=<GPU 1> (provisioned)", not why,
                     why or "as row 1"))
        # 3. GPU 0 time-sliced while a co-run client works on GPU 1.
        busy = start_client(client_env(bundle, daemon, corun, gpu1, seconds=8))
        time.sleep(2)
        result, err = finish(start_client(client_env(bundle, daemon, sliced, None, visible=gpu0)))
        why = judge_client(result, gpu0, 0, gpu0)
        busy_result, _ = finish(busy)
        busy_why = judge_client(busy_result, gpu1, 1, gpu1)
        rows.append(("GPU 0 time-sliced pod beside a GPU 1 co-run client", not why and not busy_why,
                     why or busy_why or "GPU 0 alone, no MPS, quota held; the co-run client ran on"))
        # 4. a pod given both GPUs, as an MPS client of GPU 1.
        result, err = finish(start_client(client_env(bundle, daemon, mixed, gpu1)))
        line = limiter_line(err)
        refused = "error" in result and "its pod is given GPUs" in err
        rows.append(("pod given GPU 0 and co-run GPU 1: refused", refused,
                     line if refused else f"not refused: {result} {line}"))
        # 5. the daemon's view.
        corun_gpus = daemon.status().get("corun", [])
        up = [g for g in corun_gpus if same(g.get("gpu"), gpu1) and "up" in json.dumps(g.get("state"))]
        rows.append(("status: GPU 1's MPS daemon up, GPU 0 not co-run", len(corun_gpus) == 1 and bool(up),
                     json.dumps(corun_gpus)[:200]))
    except Exception as error:  # the row says so; the daemon still stops
        rows.append(("daemon and clients", False, str(error)[:300]))
    finally:
        daemon.stop()


def run_bench(args, bundle, work, gpu0, rows):
    loads = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CUDA_LIMITER_", "CUDA_MPS_"))}
    out = work / "bench"
    try:
        # Two pods time-slicing GPU 0 (local limits, 40% each) for the bench.
        for n in range(2):
            load_env = dict(env, CUDA_VISIBLE_DEVICES=gpu0, LOAD_SECONDS=str(args.bench_timeout),
                            LD_PRELOAD=str(Path(bundle).resolve() / "libcuda_limiter.so"),
                            CUDA_LIMITER_POD=f"{TAG}-load{n}", CUDA_DEVICE_SM_LIMIT="40",
                            CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_LIMITER_LOG="warn")
            loads.append(subprocess.Popen([sys.executable, "-c", LOAD], env=load_env,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        bench = subprocess.run(
            [sys.executable, "-m", "scripts.bench", "corun", "--bundle", str(bundle), "--gpu", "1",
             "--seconds", str(args.bench_seconds), "--rounds", str(args.bench_rounds), "--out", str(out),
             "--mps-control", args.mps_control],
            cwd=ROOT, env=dict(env), capture_output=True, text=True, timeout=args.bench_timeout)
        (work / "bench.log").write_text(bench.stdout + bench.stderr)
        table = (out / "corun-bench.md").read_text() if (out / "corun-bench.md").exists() else ""
        loads_alive = all(p.poll() is None for p in loads)
        bad = [l for l in table.splitlines() if "FAIL" in l or "| failed" in l]
        ok = bench.returncode == 0 and bool(table) and "co-run" in table and not bad and loads_alive
        why = (f"exit {bench.returncode}" if bench.returncode else
               "no table" if not table else bad[0][:200] if bad else
               "GPU 0 load stopped" if not loads_alive else "every run completed, every target PASS")
        rows.append(("co-run bench on GPU 1 while GPU 0 time-slices 2 pods", ok,
                     f"{why} ({out / 'corun-bench.md'})"))
    except subprocess.TimeoutExpired:
        rows.append(("co-run bench on GPU 1 while GPU 0 time-slices 2 pods", False,
                     f"timed out after {args.bench_timeout} s (see {work / 'bench.log'})"))
    finally:
        for p in loads:
            p.kill()
            p.wait()
        for n in range(2):
            for prefix in ("gpushare-pod-", "gpushare-limits-"):
                Path(f"/dev/shm/{prefix}{TAG}-load{n}").unlink(missing_ok=True)


def cleanup(rows, started_with):
    for pod in PODS:
        for prefix in ("gpushare-pod-", "gpushare-limits-"):
            Path(f"/dev/shm/{prefix}{pod}").unlink(missing_ok=True)
    for name in TABLES.values():
        Path(f"/dev/shm/{name}").unlink(missing_ok=True)
    left = [p for p in mps_processes() if p not in started_with]
    rows.append(("nothing left: MPS daemons, shared objects", not left,
                 "clean" if not left else f"still running: {left}"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", default=None, help="work folder (default: a new one under /tmp)")
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    p.add_argument("--skip-bench", action="store_true")
    p.add_argument("--bench-seconds", type=float, default=3.0)
    p.add_argument("--bench-rounds", type=int, default=3,
                   help="the co-run bench's rounds: its latency bars are judged on their medians")
    p.add_argument("--bench-timeout", type=int, default=420)
    args = p.parse_args()
    bundle = Path(args.bundle).resolve()
    for need in ("libcuda_limiter.so", "hypervisor"):
        if not (bundle / need).exists():
            print(f"no {need} in {bundle}")
            return 2
    found = gpus()
    if len(found) < 2:
        print(f"needs two GPUs; nvidia-smi shows {len(found)}")
        return 2
    already = mps_processes()
    if already:
        print(f"an MPS daemon already runs: {already}")
        return 2
    control = shutil.which(args.mps_control) or args.mps_control
    work = Path(args.out or tempfile.mkdtemp(prefix="corun-two-gpus."))
    work.mkdir(parents=True, exist_ok=True)
    gpu0, gpu1 = found[0], found[1]
    print(f"co-run on GPU 1 ({gpu1}), GPU 0 ({gpu0}) time-sliced; work in {work}", flush=True)
    rows = []
    try:
        run_rows(args, bundle, work, control, gpu0, gpu1, rows)
        if not args.skip_bench:
            run_bench(args, bundle, work, gpu0, rows)
    finally:
        cleanup(rows, already)
    width = max(len(name) for name, _, _ in rows)
    print(f"\n{'check'.ljust(width)}  result  detail")
    for name, ok, detail in rows:
        print(f"{name.ljust(width)}  {'PASS' if ok else 'FAIL'}    {detail}")
    passed = sum(ok for _, ok, _ in rows)
    print(f"\n{passed}/{len(rows)} passed; logs in {work}")
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
