#!/usr/bin/env python3
"""Co-run mode on a real GPU: a latency pod's inference step next to a batch
pod's long kernels, time-sliced and side by side as MPS clients, in one run.
Results: a Markdown table on stdout and in OUT/corun-bench.md, raw numbers in
OUT/corun-bench.json.

Usage: corun_bench.py --bundle DIR [--out DIR] [--seconds S] [--period-us P]
                      [--sizes N N] [--reserve PCT] [--mps-control PATH]

The workers are priority_bench.py's (the latency step: 64x2048 bf16 through
four 2048^2 matmuls every P us; the batch pod: back-to-back NxN bf16 matmuls,
N=4096 ~0.2 ms, N=8192 ~1.7 ms on an H100). Runs, per batch size:
  latency alone, batch alone (no MPS, no limiter: the baselines);
  latency + unlimited batch (no MPS, no limiter);
  latency + batch under the limiter's classes (time slicing, no MPS);
  co-run: the daemon (`hypervisor serve --corun-gpu 0`) runs and supervises
  the MPS control daemon; both pods are its MPS clients with the variables
  its provisioning gives (pipe folder, active thread percentage by class,
  client priority, pinned memory limit, CUDA_LIMITER_MPS=required) and the
  limiter with a memory quota; and the batch pod alone in co-run mode (what
  the SMs kept for latency pods cost a lone batch pod).
Then, in co-run mode: the memory quota (4 GiB: 3 GiB taken, 2 GiB more
refused), from inside and from nvidia-smi; and with the MPS daemon stopped, a
client with CUDA_LIMITER_MPS=required is refused CUDA (the driver would run it
without MPS, on every SM).
Targets (co-run): latency p50 <= 1.2x and p99 <= 1.5x alone, batch >= 0.85 of
its solo throughput, a lone co-run batch pod >= 0.90 of solo.
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import priority_bench as pb  # noqa: E402  (the workers and the runner)

QUOTA = 4 << 30


class CorunBench(pb.Bench):
    """priority_bench's runner; a class of `corun-latency` or `corun-batch`
    makes the worker an MPS client of the supervised daemon."""

    def __init__(self, args):
        super().__init__(args)
        self.pipe = None
        self.reserve = args.reserve

    def env(self, cls, region, extra):
        if not (cls or "").startswith("corun-"):
            return super().env(cls, region, extra)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("CUDA_LIMITER_", "CUDA_MPS_")) and k not in ("LD_PRELOAD",)}
        self.serial += 1
        pod = f"corun-{os.getpid()}-{self.serial}"
        latency = cls == "corun-latency"
        env.update(
            LD_PRELOAD=self.lib, CUDA_LIMITER_POD=pod, CUDA_LIMITER_LOG="warn",
            CUDA_DEVICE_MEMORY_LIMIT=str(QUOTA), CUDA_LIMITER_MPS="required",
            # As provisioning gives a co-run GPU's client (provision/mps.rs).
            CUDA_MPS_PIPE_DIRECTORY=str(self.pipe),
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=str(100 if latency else 100 - self.reserve),
            CUDA_MPS_CLIENT_PRIORITY="0" if latency else "1",
            CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=f"0={QUOTA >> 20}M",
        )
        env.update(extra)
        return env, pod


class Daemon:
    """`hypervisor serve` in local mode with GPU 0 in co-run mode."""

    def __init__(self, bundle, work, reserve, control):
        self.work = work
        config = work / "hypervisor.toml"
        config.write_text('listen = "127.0.0.1:0"\n')
        self.log = open(work / "hypervisor.log", "w")
        self.proc = subprocess.Popen(
            [str(bundle / "hypervisor"), "serve", "--config", str(config), "--listen", "127.0.0.1:0",
             "--corun-gpu", "0", "--corun-dir", str(work / "mps"),
             "--corun-latency-reserve", str(reserve), "--mps-control", control],
            stdout=subprocess.PIPE, stderr=self.log, text=True,
            env={**os.environ, "HYPERVISOR_LOG": "info"})
        line = self.proc.stdout.readline()
        if not line.startswith("hypervisor listening on "):
            raise RuntimeError(f"hypervisor did not start: {line!r}")
        self.url = "http://" + line.split()[-1]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError("the co-run GPU's MPS did not come up (readyz)")
        status = self.status()
        gpu = status["corun"][0]
        self.uuid = gpu["gpu"]
        self.pipe = work / "mps" / self.uuid / "pipe"

    def status(self):
        with urllib.request.urlopen(self.url + "/api/v1/status", timeout=5) as r:
            return json.loads(r.read())

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


def mps_processes():
    out = subprocess.run(["pgrep", "-a", "nvidia-cuda-mps"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if l.strip()]


MEMORY_PROBE = r"""
import os, subprocess, torch
GIB = 1 << 30
free, total = torch.cuda.mem_get_info()
a = torch.empty(3 * GIB, dtype=torch.uint8, device="cuda")
try:
    b = torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    more = "ok"
except torch.OutOfMemoryError:
    more = "oom"
torch.cuda.synchronize()
smi = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                     capture_output=True, text=True).stdout
mine = [l for l in smi.splitlines() if l.split(",")[0].strip() == str(os.getpid())]
print(f"total={total} first=ok more={more} smi_own={mine} smi_all={smi.strip().splitlines()}", flush=True)
"""

INIT_PROBE = r"""
import torch
try:
    torch.cuda.init()
    print(f"cuda=ok devices={torch.cuda.device_count()}", flush=True)
except Exception as e:
    print(f"cuda=refused {type(e).__name__}: {str(e)[:200]}", flush=True)
"""


def probe(bench, script, cls="corun-batch"):
    env, pod = bench.env(cls, "unused", {})
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    Path(f"/dev/shm/gpushare-pod-{pod}").unlink(missing_ok=True)
    return (out.stdout.strip() + " " + out.stderr.strip()[-300:]).strip()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bundle", required=True)
    p.add_argument("--out", default=os.environ.get("OUT", "corun-bench-out"))
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--period-us", type=float, default=2000)
    p.add_argument("--sizes", type=int, nargs=2, default=[4096, 8192], metavar=("SHORT", "LONG"))
    p.add_argument("--reserve", type=int, default=20)
    p.add_argument("--mps-control", default="nvidia-cuda-mps-control")
    args = p.parse_args()
    bundle = Path(args.bundle).resolve()
    args.lib = str(bundle / "libcuda_limiter.so")
    control = subprocess.run(["sh", "-c", f"command -v {args.mps_control}"], capture_output=True,
                             text=True).stdout.strip() or args.mps_control
    bench = CorunBench(args)
    t_begin = time.monotonic()
    short, long_ = args.sizes
    print(f"co-run bench: {args.seconds:.0f} s per run, a request every {args.period_us:.0f} us, batch"
          f" matmuls {short}^2 and {long_}^2, {args.reserve}% of the SMs kept for latency pods", flush=True)
    if mps_processes():
        raise SystemExit(f"an MPS daemon already runs: {mps_processes()}")
    runs = {"latency alone": bench.run("latency alone", latency="")}
    for size in (short, long_):
        runs[f"batch alone {size}"] = bench.run(f"batch alone {size}", batch="", size=size)
        runs[f"unlimited {size}"] = bench.run(f"latency + unlimited batch {size}", latency="", batch="",
                                              size=size)
        runs[f"classes {size}"] = bench.run(f"latency + batch {size}, classes", latency="latency",
                                            batch="batch", size=size)
    work = Path(tempfile.mkdtemp(prefix="corun-bench-"))
    daemon = Daemon(bundle, work, args.reserve, control)
    checks = {}
    try:
        bench.pipe = daemon.pipe
        for size in (short, long_):
            runs[f"corun {size}"] = bench.run(f"latency + batch {size}, co-run", latency="corun-latency",
                                              batch="corun-batch", size=size)
            runs[f"corun batch alone {size}"] = bench.run(f"batch alone {size}, co-run",
                                                          batch="corun-batch", size=size)
        checks["memory quota under MPS"] = probe(bench, MEMORY_PROBE)
        checks["MPS processes while up"] = mps_processes()
        checks["daemon status"] = daemon.status().get("corun")
    finally:
        daemon.stop()
    checks["MPS processes after stop"] = mps_processes()
    checks["required, MPS stopped"] = probe(bench, INIT_PROBE)
    report(args, runs, checks, time.monotonic() - t_begin)


def report(args, runs, checks, took):
    out = Path(args.out)
    pct = pb.pct
    alone = runs["latency alone"].get("latency")
    if alone is None:
        print(f"no baseline: {runs['latency alone']}")
        return
    p50_alone, p99_alone = pct(alone["steps_us"], .5), pct(alone["steps_us"], .99)
    rows = [("latency alone (no MPS, no limiter)", f"{p50_alone:.0f}", f"{p99_alone:.0f}", "", "", "")]
    verdicts = []
    for size in args.sizes:
        solo = runs[f"batch alone {size}"].get("batch")
        for key, label in ((f"unlimited {size}", "+ unlimited batch"), (f"classes {size}", "+ batch, classes"),
                           (f"corun {size}", "+ batch, co-run (MPS)"),
                           (f"corun batch alone {size}", "batch alone, co-run (MPS)")):
            run = runs[key]
            if "error" in run or solo is None:
                rows.append((f"{label} ({size}^2)", "failed", "", "", "", str(run.get("error", ""))[-200:]))
                continue
            bat = run["batch"]
            ratio = bat["per_s"] / solo["per_s"]
            lat = run.get("latency")
            c50 = c99 = ""
            verdict = ""
            if lat:
                p50, p99 = pct(lat["steps_us"], .5), pct(lat["steps_us"], .99)
                c50, c99 = f"{p50:.0f} ({p50 / p50_alone:.2f}x)", f"{p99:.0f} ({p99 / p99_alone:.2f}x)"
                if key.startswith("corun"):
                    ok = p50 <= 1.2 * p50_alone and p99 <= 1.5 * p99_alone and ratio >= 0.85
                    verdict = f"{'PASS' if ok else 'FAIL'} (p50<=1.2x, p99<=1.5x, batch>=0.85)"
            elif key.startswith("corun"):
                verdict = f"{'PASS' if ratio >= 0.90 else 'FAIL'} (lone batch >= 0.90)"
            if verdict:
                verdicts.append(f"{label} {size}^2: {verdict}")
            rows.append((f"{label} ({solo['kernel_ms']:.2f} ms kernels)", c50, c99,
                         f"{bat['per_s']:.1f} / {solo['per_s']:.1f}", f"{ratio:.3f}", verdict))
    head = ("| run | latency p50 us (vs alone) | p99 us (vs alone) | batch matmuls/s (run / solo) | ratio |"
            " verdict |\n|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    text = (f"Co-run bench, a request every {args.period_us:.0f} us, {args.seconds:.0f} s per run,"
            f" {args.reserve}% of the SMs kept ({took:.0f} s in all)\n\n{table}\n"
            + "".join(f"- {v}\n" for v in verdicts)
            + "".join(f"- {k}: {v}\n" for k, v in checks.items()))
    (out / "corun-bench.md").write_text(text)
    (out / "corun-bench.json").write_text(json.dumps({"args": vars(args), "runs": runs, "checks": checks},
                                                     indent=1, default=str))
    print()
    print(text)


if __name__ == "__main__":
    main()
