"""The benchmarks (python3 -m scripts.bench) without a GPU: every subcommand
parses its options; they use the GPU check's harness (its sampler,
statistics, process runs and daemon), not copies of their own; and each runs
through against fakebench.py (nvidia-smi, nvcc, compute_bench, the workers,
torch_workloads.py, the packing workers), the co-run and packing ones with
the real daemon (--simulate-gpus) and the fake MPS control daemon when
target/ has them built; the packing bench's figures from known inputs."""

import inspect
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
BENCH = REPO / "scripts" / "bench"
HARNESS = REPO / "scripts" / "gpu" / "e2e" / "harness"
if str(REPO) not in sys.path:  # python3 -m pytest from elsewhere than the repository root
    sys.path.append(str(REPO))  # the package by its own name, scripts.bench, as the entry point has it

from scripts.bench import (common, compute, corun, corun_ab, corun_frontier, launch, packing,  # noqa: E402
                           packing_daemon, packing_plan, packing_report, priority)
from scripts.bench.__main__ import SUBCOMMANDS, main, parser  # noqa: E402
from scripts.gpu.e2e.harness import hv, parse, proc, smi  # noqa: E402

from builds import built  # noqa: E402

FAKE = HERE / "fakebench.py"



@pytest.fixture
def fakes(tmp_path, monkeypatch):
    """fakebench.py as nvidia-smi and nvcc on PATH and as the programs the
    benches run; an empty limiter in a bundle folder; the results folder."""
    path = tmp_path / "path"
    path.mkdir()
    for name in ("nvidia-smi", "nvcc", "workers.py", "torch_workloads.py"):
        (path / name).symlink_to(FAKE)
    monkeypatch.setenv("PATH", f"{path}:{os.environ['PATH']}")
    monkeypatch.setenv("NVCC", str(path / "nvcc"))
    monkeypatch.delenv("OUT", raising=False)
    monkeypatch.setattr(common, "WORKERS", path / "workers.py")
    monkeypatch.setattr(common, "TORCH_WORKLOADS", path / "torch_workloads.py")
    monkeypatch.setattr(priority, "START_S", 0.05)
    monkeypatch.setattr(compute, "SAMPLE_MS", 20)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "libcuda_limiter.so").write_bytes(b"")  # preloaded by nothing real: the fakes only read the variables
    return bundle, tmp_path / "out"


def test_help_of_every_subcommand():
    def run(*args):
        return subprocess.run([sys.executable, "-m", "scripts.bench", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60)

    top = run("--help")
    assert top.returncode == 0, top.stderr
    for name in SUBCOMMANDS:
        assert name in top.stdout
        r = run(name, "--help")
        assert r.returncode == 0 and r.stdout.startswith(f"usage: python3 -m scripts.bench {name} "), r.stderr
    assert run().returncode == 2 and run("compute").returncode == 2  # no subcommand; no limiter


def test_options_parse():
    """Every option of the scripts they replace, under its subcommand."""
    top, _ = parser()
    a = top.parse_args(["compute", "--bundle", "b", "--only", "shapes", "fixed", "--quick", "--cpus", "1,2",
                        "--fixed-us", "50", "--rounds", "pace=10", "--pace-iterations", "100", "--bin", "x",
                        "--out", "o", "--lib", "l"])
    assert (a.only, a.quick, a.cpus, a.fixed_us, a.rounds, a.pace_iterations, a.bin) == (
        ["shapes", "fixed"], True, "1,2", [50], ["pace=10"], 100, "x")
    a = top.parse_args(["priority", "--bundle", "b", "--quick", "--seconds", "6", "--period-us", "1000",
                        "--sizes", "1", "2", "--out", "o"])
    assert (a.bundle, a.seconds, a.period_us, a.sizes, a.out) == ("b", 6.0, 1000.0, [1, 2], "o")
    corun_common = ["--bundle", "b", "--out", "o", "--seconds", "2", "--period-us", "500", "--sizes", "1", "2",
                    "--mps-control", "m"]
    a = top.parse_args(["corun", *corun_common, "--reserve", "30", "--rounds", "2"])
    assert (a.reserve, a.rounds, a.mps_control, a.sizes) == (30, 2, "m", [1, 2])
    a = top.parse_args(["corun-ab", *corun_common, "--reserve", "25", "--phase-ms", "500", "--settle-ms", "50",
                        "--arms", "client,l2", "--l2-percent", "40"])
    assert (a.reserve, a.phase_ms, a.settle_ms, a.arms, a.l2_percent) == (25, 500.0, 50.0, "client,l2", 40)
    a = top.parse_args(["corun-frontier", *corun_common, "--reserves", "10", "20", "--rounds", "1", "--pin-cpu",
                        "3", "--whole-gpu"])
    assert (a.reserves, a.rounds, a.pin_cpu, a.whole_gpu) == ([10, 20], 1, 3, True)
    a = top.parse_args(["launch-ab", "lib.so", "60", "90"])
    assert (a.lib, a.pace_s, a.decode_s) == ("lib.so", 60.0, 90.0)
    assert top.parse_args(["launch-ab", "lib.so"]).pace_s == 90
    a = top.parse_args(["launch-cost", "--seconds", "30", "a.so", "b.so"])
    assert (a.seconds, a.limiters, a.mimic) == (30.0, ["a.so", "b.so"], False)
    assert top.parse_args(["launch-cost", "--mimic"]).mimic
    a = top.parse_args(["torch", "decode-ab", "8"])
    assert (a.mode, a.seconds) == ("decode-ab", "8")
    with pytest.raises(SystemExit):
        top.parse_args(["compute", "--only", "nothing"])


def test_the_harness_is_what_they_use():
    """One sampler, one set of statistics, one process runner, one daemon:
    the harness's; no bench module edits sys.path or runs nvidia-smi's loop."""
    assert compute.Sampler is smi.Sampler and isinstance(priority.clock_sampler(), smi.Sampler)
    assert compute.med is parse.median and corun.med is parse.median and launch.med is parse.median
    assert priority.pct is parse.percentile and corun_ab.pct is parse.percentile
    assert corun_frontier.pct is parse.percentile and corun.pct is parse.percentile
    assert compute.fields is parse.fields and launch.fields is parse.fields
    assert compute.difference_interval is parse.difference_interval
    assert corun_ab.median_interval is parse.median_interval and launch.mean_halfwidth is parse.mean_halfwidth
    assert priority.proc is proc and issubclass(corun.CorunDaemon, hv.Daemon)
    assert issubclass(corun_frontier.FrontierBench, corun.CorunBench) and issubclass(corun.CorunBench,
                                                                                   priority.Bench)
    for fn in (compute.med, priority.pct, compute.Sampler):
        assert Path(inspect.getsourcefile(fn)).parent == HARNESS
    for f in BENCH.glob("*.py"):
        text = f.read_text()
        assert "sys.path" not in text, f
        assert "-lms" not in text and "def median" not in text and "def pct" not in text, f
        if f.name not in ("workers.py", "torch_workloads.py"):  # programs of their own: the standard library
            assert "statistics.median" not in text, f


def test_sampler(tmp_path, monkeypatch, fakes):
    with smi.Sampler(["clocks.sm", "power.draw"], 50, gpu=0) as s:
        t0 = time.monotonic()
        while len(s.samples) < 3 and time.monotonic() < t0 + 10:
            time.sleep(0.05)
    assert len(s.samples) >= 3 and s.values(0)[0] == 1980 and s.median(1) == 300.5  # "[N/A]" skipped
    assert s.between(t0, t0 + 10)[0][1:] == (1980, 300.5) and s.between(t0 + 10, t0 + 20) == []
    assert s.busy_mean(0) == 1980
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no samples
    with smi.Sampler(["utilization.gpu"], 50) as none:
        pass
    assert none.samples == [] and math.isnan(none.median()) and math.isnan(none.busy_mean())


def test_process_sampler(tmp_path, monkeypatch, fakes):
    assert smi.pmon_sample("    0     123  C    22    3    -    -    -    -   python3") == (123, 22.0)
    assert smi.pmon_sample("    0  123  M+C  -  -  -  -  python3") == (123, None)
    for other in ("# gpu pid type sm", "    0      -     -     -     -   -", "", "garbage"):
        assert smi.pmon_sample(other) is None
    t0 = time.monotonic()
    with smi.ProcessSampler(gpu=0) as s:
        while len(s.samples) < 6 and time.monotonic() < t0 + 10:
            time.sleep(0.05)
    assert {pid for _, pid, _ in s.samples} == {4242, 4243}
    # A second in: every sample counts; 4243 printed none, 7 is not listed.
    shares = s.shares([4242, 4243, 7], t0 - 1.0, time.monotonic())
    assert shares[4242]["sm_pct"] == 30 and shares[4242]["samples"] >= 3
    assert shares[4243] == {"sm_pct": None, "samples": 0} and shares[7] == {"sm_pct": None, "samples": 0}
    # Samples in the window's first second are left out.
    first = min(t for t, _, _ in s.samples)
    assert s.shares([4242], first - 0.5, time.monotonic())[4242]["samples"] == 0
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi: no samples
    with smi.ProcessSampler() as none:
        pass
    assert none.samples == [] and none.shares([1], 0, 1e9) == {1: {"sm_pct": None, "samples": 0}}


def test_packing_gpu_window():
    clocks = smi.Sampler.__new__(smi.Sampler)  # no nvidia-smi: samples given
    clocks.samples = [(10.5, (1700.0, 600.0, 40.0)), (11.2, (1750.0, 650.0, 90.0)), (11.9, (1800.0, 700.0, 94.0)),
                      (20.0, (345.0, 60.0, 0.0))]
    window = packing.gpu_window(clocks, 10.0, 12.0)
    # The clock and power through the window; utilisation from a second in.
    assert window == {"sm_mhz": 1750.0, "power_w": 650.0, "busy_pct": 92.0, "samples": 3}
    clocks.samples = [(10.5, (1700.0, 600.0, 40.0))]
    assert packing.gpu_window(clocks, 10.0, 12.0)["busy_pct"] is None
    assert packing.gpu_window(clocks, 30.0, 40.0) is None


def test_statistics():
    assert parse.percentile([1, 2, 3, 4], 0.5) == 2.5 and parse.percentile([5], 0.99) == 5
    assert math.isnan(parse.percentile([], 0.5))
    assert parse.fields("mode=pace x=1=2 junk") == {"mode": "pace", "x": "1=2"}
    lo, hi = parse.difference_interval([1, 2, 3], [2, 3, 4])
    assert lo < 1 < hi
    assert parse.median_interval([1.0, 1.0, 1.0], draws=100) == (1.0, 1.0)
    assert math.isnan(parse.mean_halfwidth([1.0]))


def test_compute(fakes):
    bundle, out = fakes
    rc = main(["compute", "--bundle", str(bundle), "--out", str(out), "--quick",
               "--cpus", ",".join(map(str, sorted(os.sched_getaffinity(0))[:2])),
               "--fixed-us", "50", "--rounds", "shapes=1", "shapes-long=1", "decode=1", "pace=2", "pace-no-limit=2"])
    table = (out / "compute-bench.md").read_text()
    assert rc == 0, table
    assert "| decode-L10 |" in table and "42.0% busy" in table and "FAIL" not in table
    assert table.splitlines()[-1].startswith("20 passed, 0 failed")


def test_priority(fakes, capsys):
    bundle, out = fakes
    main(["priority", "--bundle", str(bundle), "--out", str(out), "--seconds", "0.3"])
    assert "  latency alone: latency p50 304 us p99 309 us" in capsys.readouterr().out  # and the clock, sampled
    text = (out / "priority-bench.md").read_text()
    assert "| + batch, classes (0.20 ms kernels) |" in text and "Failed runs" not in text, text
    assert "Criteria (~0.2 ms batch kernels): " in text
    logs = sorted(out.glob("worker-*-latency.log"))
    assert logs and re.search(r"^ready=1$", logs[0].read_text(), re.MULTILINE)


corun_built = pytest.mark.skipif(not (built("hypervisor") and built("nvidia-cuda-mps-control")),
                                 reason="needs the daemon and the fake nvidia-cuda-mps-control built (builds.py)")


@pytest.fixture
def corun_env(fakes, monkeypatch):
    bundle, out = fakes
    (bundle / "hypervisor").symlink_to(built("hypervisor"))
    monkeypatch.setattr(corun, "SIMULATE", "1")
    if corun.mps_processes():
        pytest.skip(f"an MPS daemon runs: {corun.mps_processes()}")
    yield bundle, out, ["--bundle", str(bundle), "--out", str(out), "--seconds", "0.3", "--mps-control",
                        str(built("nvidia-cuda-mps-control"))]
    assert corun.mps_processes() == []
    left = [p for p in os.listdir("/dev/shm") if re.match(rf"gpushare-.*(corun-|bench-{os.getpid()})", p)]
    assert not left, left


@corun_built
def test_corun(corun_env):
    _, out, args = corun_env
    main(["corun", *args, "--rounds", "1"])
    text = (out / "corun-bench.md").read_text()
    assert "| + batch, co-run (MPS) (0.20 ms kernels; median of 1) |" in text, text
    assert "- daemon status: [{" in text and "failed" not in text
    assert {"hypervisor.log", "hypervisor-server-fails.log"} <= {p.name for p in out.iterdir()}


@corun_built
def test_corun_ab_and_frontier(corun_env):
    _, out, args = corun_env
    main(["corun-ab", *args, "--arms", "client,whole,window,l2", "--phase-ms", "50", "--settle-ms", "0"])
    text = (out / "corun-ab.md").read_text()
    assert text.count("| 4096^2 (0.20 ms) |") == 4 and "failed" not in text, text
    assert {"hypervisor-l2-0.log", "hypervisor-l2-60.log"} <= {p.name for p in out.iterdir()}
    main(["corun-frontier", *args, "--reserves", "10", "20", "--rounds", "1", "--pin-cpu",
          str(min(os.sched_getaffinity(0))), "--whole-gpu"])
    text = (out / "corun-frontier.md").read_text()
    assert "| 20% | co-run, latency client on every SM, 0.20 ms kernels |" in text and "failed" not in text, text


def test_launch(fakes, capsys):
    bundle, out = fakes
    lib = str(bundle / "libcuda_limiter.so")
    assert main(["launch-ab", lib, "0.3", "0.3", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "launch call, full - bypass, ns: median +10.0" in printed and "decode-ab, " in printed, printed
    assert (out / "pace-ab.txt").is_file() and (out / "decode-ab.txt").is_file()
    assert main(["launch-cost", "--seconds", "0.3", lib, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no limiter (" in printed and "  against no limiter, by window: +0.00% (+0 ns)" in printed, printed
    assert main(["launch-cost", "--mimic", "--seconds", "0.2"]) == 0
    assert "round 1 mode 4 (sample, events without timing): iteration " in capsys.readouterr().out


def test_torch_runs_the_program_itself(monkeypatch):
    seen = []
    monkeypatch.setattr(os, "execv", lambda exe, argv: seen.append((exe, argv)))
    main(["torch", "decode", "5"])
    assert seen == [(sys.executable, [sys.executable, str(common.TORCH_WORKLOADS), "decode", "5"])]


def test_packing_admission_quantiles_as_prometheus():
    text = "\n".join([
        'gpushare_admission_latency_seconds_bucket{le="0.001"} 50',
        'gpushare_admission_latency_seconds_bucket{le="0.002"} 90',
        'gpushare_admission_latency_seconds_bucket{le="+Inf"} 100',
        "gpushare_admission_latency_seconds_sum 0.2", "gpushare_admission_latency_seconds_count 100",
        "gpushare_admission_timeouts_total 3", "other_metric 1"])
    before = packing_daemon.parse_admission(text.replace(" 50", " 10").replace(" 90", " 10")
                                            .replace("} 100", "} 10").replace("count 100", "count 10"))
    after = packing_daemon.parse_admission(text)
    assert after["count"] == 100 and after["timeouts"] == 3 and after["buckets"][-1] == (math.inf, 100)
    delta = packing_daemon.admission_delta(before, after)
    assert delta["buckets"] == [(0.001, 40), (0.002, 80), (math.inf, 90)] and delta["count"] == 90
    # Linear inside a bucket from the one below's bound; +Inf past the last.
    assert packing_daemon.quantile(delta["buckets"], 0.25) == pytest.approx(0.0005625)
    assert packing_daemon.quantile(delta["buckets"], 0.5) == pytest.approx(0.001125)
    assert packing_daemon.quantile(delta["buckets"], 0.99) == math.inf
    assert packing_daemon.quantile([(0.001, 0), (math.inf, 0)], 0.5) is None
    summary = packing_daemon.admission_summary(delta)
    assert summary["requests"] == 90 and summary["p50_ms"] == pytest.approx(1.125)
    assert packing_daemon.parse_admission("other_metric 1") is None


def test_packing_shares_targets_and_verdicts():
    # 16 co-run pods at 6.0% of the lone process's throughput each, which
    # kept the GPU 90% busy: each holds 5.4% of the GPU's time.
    corun16 = packing_plan.Spec("kernels", packing_plan.MODES["corun"], 16, "corun N=16")
    want = packing_plan.targets(corun16.mode, 16, busy=0.9)
    assert want == [6.25] * 16
    summary = packing_report.shares([60.0] * 16, 1000.0, 0.9, want)
    assert summary["shares"] == pytest.approx([5.4] * 16) and summary["aggregate"] == pytest.approx(96.0)
    assert summary["max_dev_pp"] == pytest.approx(-0.85) and summary["spread_pp"] == pytest.approx(0)
    # Co-run N=16 is judged on its aggregate; elastic weights sum to 100%,
    # so no share verdict.
    assert packing_report.verdicts(corun16, summary, want, None) == {"aggregate": False}
    # A lone elastic pod's share is all of the GPU, whatever its workload
    # keeps busy: not judged.
    corun1 = packing_plan.Spec("infer", packing_plan.MODES["corun"], 1, "corun N=1")
    assert packing_plan.targets(corun1.mode, 1, busy=0.89) == [89.0]
    assert "shares" not in packing_report.verdicts(corun1, summary, [89.0], None)
    # Fixed caps: floor(90/N)%, at most what the workload keeps busy alone;
    # judged on every pod within 1 pp; at N=32 on the daemon's CPU and p99
    # too, a figure it lacks failing.
    timeslice32 = packing_plan.Spec("infer", packing_plan.MODES["timeslice"], 32, "timeslice N=32")
    want = packing_plan.targets(timeslice32.mode, 32)
    assert want == [2.0] * 32 and packing_plan.targets(timeslice32.mode, 1, busy=0.5) == [50.0]
    summary = packing_report.shares([20.0] * 31 + [29.0], 1000.0, 1.0, want)
    daemon = {"cpu_pct": 1.2, "admission": {"requests": 0}}
    assert packing_report.verdicts(timeslice32, summary, want, daemon) == {
        "shares": True, "cpu": True, "p99": True}
    summary = packing_report.shares([20.0] * 31 + [31.0], 1000.0, 1.0, want)
    daemon = {"cpu_pct": None, "admission": {"requests": 4, "p99_ms": 2.5}}
    assert packing_report.verdicts(timeslice32, summary, want, daemon) == {
        "shares": False, "cpu": False, "p99": False}
    # With returns, p99 is judged on the window's admissions and theirs
    # together: a quiet window does not pass a slow return.
    daemon = {"cpu_pct": 1.2, "admission": {"requests": 0}}
    slow = {"admission": {"requests": 3, "p99_ms": 9.0}, "admission_with_window": {"requests": 3, "p99_ms": 9.0}}
    assert packing_report.verdicts(timeslice32, summary, want, daemon, slow)["p99"] is False
    quick = {"admission_with_window": {"requests": 40, "p99_ms": 1.5}}
    assert packing_report.verdicts(timeslice32, summary, want, daemon, quick)["p99"] is True
    assert packing_report.verdicts(timeslice32, summary, want, daemon, {"admission_with_window": None})["p99"] is False


def test_packing_turns_mode():
    # A time-sliced mode of fixed caps whose daemon has GPU 0's pods take
    # turns of --turn-ms; the default modes run it between the others.
    turns = packing_plan.MODES["turns"]
    assert (turns.daemon, turns.corun, turns.policy, turns.turn_ms) == (True, False, "fixed", packing_plan.TURN_MS)
    assert all(m.turn_ms is None for name, m in packing_plan.MODES.items() if name != "turns")
    top, _ = parser()
    a = top.parse_args(["packing", "--bundle", "b"])
    assert (a.modes, a.turn_ms) == (["timeslice", "turns", "corun"], 10)
    a = top.parse_args(["packing", "--bundle", "b", "--modes", "turns", "--turn-ms", "12"])
    assert (a.modes, a.turn_ms) == (["turns"], 12)
    modes = packing_plan.with_turn_ms([packing_plan.MODES[m] for m in ("timeslice", "turns", "corun")], 12)
    assert [m.turn_ms for m in modes] == [None, 12, None] and modes[0] is packing_plan.MODES["timeslice"]
    # Its runs: one per N and workload, estimated as the time-sliced ones
    # (the default plan: 42 runs).
    specs = packing_plan.plan(["kernels", "infer"], [1, 4, 8, 16, 32], modes)
    assert len(specs) == 42 and [s.label for s in specs if s.workload == "kernels"][:5] == [
        "solo", "no limiter N=32", "timeslice N=32", "turns N=32", "corun N=32"]
    est = {s.label: packing_plan.estimate_s(s, 5.0) for s in specs if s.workload == "infer" and s.n == 8}
    assert est["turns N=8"] == est["timeslice N=8"] < est["corun N=8"]
    order = packing_plan.table_order(specs, ["kernels", "infer"], modes)
    assert [specs[i].label for i in order][:5] == ["solo", "timeslice N=1", "turns N=1", "corun N=1",
                                                 "no limiter N=4"]
    # Judged as the time-sliced runs: caps, every pod within 1 pp, and at
    # N=32 the daemon's CPU and p99.
    turns32 = packing_plan.Spec("kernels", modes[1], 32, "turns N=32")
    want = packing_plan.targets(turns32.mode, 32)
    assert want == [2.0] * 32
    summary = packing_report.shares([20.0] * 31 + [29.0], 1000.0, 1.0, want)
    assert packing_report.verdicts(turns32, summary, want, {"cpu_pct": 1.2, "admission": {"requests": 0}}) == {
        "shares": True, "cpu": True, "p99": True}
    summary = packing_report.shares([20.0] * 31 + [31.0], 1000.0, 1.0, want)
    assert packing_report.verdicts(turns32, summary, want, {"cpu_pct": 1.2, "admission": {"requests": 0}}) == {
        "shares": False, "cpu": True, "p99": True}


def test_packing_daemon_of_turns(tmp_path):
    args = (tmp_path / "bundle", tmp_path, tmp_path / "work", "t")  # bundle, logs, work, tag
    turns = packing_plan.with_turn_ms([packing_plan.MODES["turns"]], 7)[0]
    daemon = packing_daemon.PackingDaemon(*args, turns, ["p-0", "p-1"], "mps-control")
    assert daemon.serve_args == ["--turns-gpu", "0", "--turn-ms", "7"] and daemon.ready is None
    assert 'cap = 45' in (tmp_path / "t.toml").read_text()
    timeslice = packing_daemon.PackingDaemon(*args, packing_plan.MODES["timeslice"], ["p-0"], "mps-control")
    assert timeslice.serve_args == []
    # GPU 0's turns from the status; the handovers over a window.
    status = {"turns": [{"gpu": "GPU-a", "index": 0, "takes_turns": True, "quantum_us": 7000, "handovers": 40},
                        {"gpu": "GPU-b", "index": 1, "takes_turns": False, "quantum_us": 0, "handovers": 0}]}
    assert packing_daemon.gpu_turns(status) == {"quantum_us": 7000, "handovers": 40}
    assert packing_daemon.gpu_turns({"turns": status["turns"][1:]}) is None and packing_daemon.gpu_turns({}) is None
    before = {"t": 10.0, "cpu_s": 1.0, "rss_mib": 30.0, "admission": None, "charged_ns": {},
              "turns": {"quantum_us": 7000, "handovers": 40}}
    after = {**before, "t": 15.0, "turns": {"quantum_us": 7000, "handovers": 1040}}
    assert packing_daemon.daemon_figures(before, after)["turns"] == {
        "turn_ms": 7.0, "handovers": 1000, "handovers_per_s": pytest.approx(200.0)}
    assert packing_daemon.daemon_figures({**before, "turns": None}, after)["turns"] is None


def lone_run(per_s, busy_pct=None, step_ms=None, label="solo", ran=None):
    """A lone run of the inference step that ran, as the runner gives it."""
    pod = {"per_s": per_s, **({"step_ms": step_ms} if step_ms else {}),
           **({"kernel_busy": ran, "gaps_3us": 0.04, "gaps_3us_n": 9000, "gaps_10us": 0.005, "gaps_longer": 0.002}
              if ran else {})}
    return {"spec": packing_plan.Spec("infer", packing_plan.SOLO, 1, label),
            "result": {"tag": label, "pods": [pod],
                       "gpu": {"sm_mhz": 1980.0, "power_w": 700.0, "busy_pct": busy_pct, "samples": 50}}}


def test_packing_baseline_nvml_before_the_warm_up():
    # The warm-up reads 4,000 steps/s x 0.21 ms = 84% busy; NVML read the
    # two windows 94% and 96% busy: the shares are judged on NVML's mean.
    runs = [lone_run(4000.0, 94.0, 0.25), lone_run(4000.0, 96.0, 0.21, "solo again")]
    base = packing_report.baseline(runs, "infer", {})
    assert base == {"per_s": 4000.0, "busy": pytest.approx(0.95), "by": "nvml", "cupti": None,
                    "nvml": pytest.approx(0.95), "warmup": pytest.approx(0.84), "unit_ms": pytest.approx(0.21)}
    # The mean of the lone runs that have a reading; at most all of the time.
    assert packing_report.baseline([lone_run(4000.0, None, 0.21), lone_run(4000.0, 90.0)], "infer", {})[
        "nvml"] == pytest.approx(0.9)
    assert packing_report.baseline([lone_run(4000.0, 100.4, 0.21)], "infer", {})["busy"] == 1.0
    # No NVML reading: the warm-up's; neither: all of the GPU's time.
    base = packing_report.baseline([lone_run(4000.0, None, 0.21), lone_run(4000.0, None, 0.21)], "infer", {})
    assert (base["by"], base["busy"], base["nvml"]) == ("warm-up", pytest.approx(0.84), None)
    base = packing_report.baseline([lone_run(4000.0)], "infer", {})
    assert (base["by"], base["busy"], base["warmup"]) == ("none", 1.0, None)
    assert packing_report.baseline([], "infer", {}) is None
    # The kernels' warm-up reading is the calibrated kernel's.
    kernels = [{**lone_run(2000.0, 99.0), "spec": packing_plan.Spec("kernels", packing_plan.SOLO, 1, "solo")}]
    base = packing_report.baseline(kernels, "kernels", {"kernel_us": "450.00"})
    assert (base["by"], base["busy"], base["warmup"]) == ("nvml", pytest.approx(0.99), pytest.approx(0.9))


def test_packing_shares_by_cupti_first():
    # The lone process's kernels ran 94% and 96% of its windows by CUPTI:
    # the baseline, before NVML's 99%.
    runs = [lone_run(4000.0, 99.0, 0.21, ran=0.94), lone_run(4000.0, 99.0, 0.21, "solo again", 0.96),
            lone_run(4000.0, 99.0, 0.21, "solo once more")]
    base = packing_report.baseline(runs, "infer", {})
    assert (base["by"], base["busy"], base["cupti"], base["nvml"]) == (
        "cupti", pytest.approx(0.95), pytest.approx(0.95), pytest.approx(0.99))
    assert packing_report.baseline([lone_run(4000.0, 99.0)], "infer", {})["by"] == "nvml"
    # Pods that CUPTI timed, every one: their shares are the time their
    # kernels ran; one without it: all by throughput.
    spec = packing_plan.Spec("infer", packing_plan.MODES["turns"], 2, "turns N=2")
    pods = [{"per_s": 1900.0, "kernel_busy": 0.452}, {"per_s": 1800.0, "kernel_busy": 0.446}]
    runs.append({"spec": spec, "result": {"tag": "t", "pods": pods}})
    bases = packing_report.evaluate(runs, {})
    fig = runs[-1]["figures"]
    assert fig["by"] == "cupti" and fig["shares"] == pytest.approx([45.2, 44.6]) and fig["targets"] == [45.0, 45.0]
    assert fig["max_dev_pp"] == pytest.approx(-0.4) and fig["verdicts"] == {"shares": True}
    notes = packing_report.notes(runs, ["infer"], bases)
    [line] = [x for x in notes if x.startswith("infer, each pod's kernels")]
    assert line.endswith("; turns N=2 44.60–45.20 (sum 89.8), by throughput 42.75–45.12"), line
    assert ("infer alone, the GPU idle between its kernels by CUPTI, % of the window, in gaps up to 3 us (how many)"
            " / 3 to 10 us / longer: solo 4.0% (9,000) / 0.5% / 0.2%; solo again 4.0% (9,000) / 0.5% / 0.2%") in notes
    # Time-sliced pods launching at once: by throughput, CUPTI's beside it.
    runs[-1]["spec"] = packing_plan.Spec("infer", packing_plan.MODES["timeslice"], 2, "timeslice N=2")
    packing_report.evaluate(runs, {})
    assert runs[-1]["figures"]["by"] == "throughput"
    runs[-1]["spec"] = spec
    del pods[1]["kernel_busy"]
    packing_report.evaluate(runs, {})
    assert runs[-1]["figures"]["by"] == "throughput"
    assert runs[-1]["figures"]["shares"] == pytest.approx([1900 / 4000 * 95, 1800 / 4000 * 95])


def test_packing_kernel_timing_builds_against_cupti(tmp_path, monkeypatch):
    monkeypatch.setenv("CUPTI_HOME", str(tmp_path / "cupti"))
    lib, why = packing.build_kernel_time(tmp_path)
    assert lib is None and why == f"no CUPTI (its header and library) in {tmp_path / 'cupti'}"
    (tmp_path / "cupti" / "include").mkdir(parents=True)
    (tmp_path / "cupti" / "include" / "cupti_activity.h").write_text("")
    (tmp_path / "cupti" / "lib").mkdir()
    (tmp_path / "cupti" / "lib" / "libcupti.so.13").write_text("")
    seen = []
    monkeypatch.setattr(packing, "nvcc", lambda args: seen.append(args) or None)
    lib, where = packing.build_kernel_time(tmp_path)
    assert (lib, where) == (tmp_path / "kernel_time.so", str(tmp_path / "cupti" / "lib" / "libcupti.so.13"))
    assert seen[0][-3:] == ["-l:libcupti.so.13", f"-Xlinker=-rpath={tmp_path / 'cupti' / 'lib'}", "-lpthread"]
    assert str(packing.KERNEL_TIME_C) in seen[0] and packing.KERNEL_TIME_C.is_file()
    monkeypatch.setattr(packing, "nvcc", lambda args: "nvcc ...: exit 1")
    assert packing.build_kernel_time(tmp_path) == (None, "nvcc ...: exit 1")
    # Without $CUPTI_HOME: PyTorch's nvidia wheels (where there are), then
    # the toolkit of the nvcc the bench runs.
    monkeypatch.delenv("CUPTI_HOME")
    (tmp_path / "cuda" / "bin").mkdir(parents=True)
    (tmp_path / "cuda" / "bin" / "nvcc").write_text("#!/bin/sh\n")
    (tmp_path / "cuda" / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setenv("NVCC", str(tmp_path / "cuda" / "bin" / "nvcc"))
    assert packing.cupti_roots()[-2:] == [tmp_path / "cuda" / "extras" / "CUPTI", tmp_path / "cuda"]


def test_packing_baseline_in_figures_and_notes():
    timeslice = packing_plan.Spec("infer", packing_plan.MODES["timeslice"], 2, "timeslice N=2")
    pods = [{"per_s": 1000.0}, {"per_s": 1000.0}]
    runs = [lone_run(4000.0, 95.0, 0.21), {"spec": timeslice, "result": {"tag": "ts", "pods": pods}}]
    bases = packing_report.evaluate(runs, {})
    assert bases["infer"]["by"] == "nvml"
    # A quarter of the lone process's steps, which kept it 95% busy.
    assert runs[1]["figures"]["shares"] == pytest.approx([23.75, 23.75])
    assert runs[1]["figures"]["targets"] == [45.0, 45.0] and runs[1]["figures"]["baseline"] == "nvml"
    [line] = [x for x in packing_report.notes(runs, ["infer"], bases) if x.startswith("infer alone")]
    assert line == ("infer alone: 4,000.0 steps/s; warm-up baseline 84.0% (a step 0.210 ms on the GPU alone),"
                    " NVML baseline 95.0%: baseline used: NVML")
    assert packing_report.row(runs[0])[2] == "the baseline (GPU 95.0% busy, by NVML)"
    runs[0]["result"]["gpu"]["busy_pct"] = None  # no NVML sample a second in
    bases = packing_report.evaluate(runs, {})
    assert runs[1]["figures"]["shares"] == pytest.approx([21.0, 21.0])
    assert packing_report.baseline_note("infer", bases["infer"]) == (
        "warm-up baseline 84.0% (a step 0.210 ms on the GPU alone), NVML baseline none: baseline used: the"
        " warm-up")


def test_packing_table_by_mode():
    modes = packing_plan.with_turn_ms([packing_plan.MODES[m] for m in ("timeslice", "turns", "corun")], 5)

    def run(mode, n, per_s, charged=None, split=None):
        spec = packing_plan.Spec("kernels", mode, n, f"{mode.name} N={n}")
        daemon = {"charged_pct": {f"{mode.name}-{i}": c for i, c in enumerate(charged or [])},
                  "capacity_pct": split} if mode.daemon else None
        return {"spec": spec, "result": {"tag": mode.name, "pods": [{"per_s": x} for x in per_s], "daemon": daemon}}

    runs = [{**lone_run(1000.0, 100.0), "spec": packing_plan.Spec("kernels", packing_plan.SOLO, 1, "solo")},
            run(packing_plan.UNLIMITED, 2, [450.0, 450.0]),
            run(modes[0], 2, [440.0, 450.0], [44.1, 45.0]), run(modes[1], 2, [430.0, 470.0], [43.0, 47.0]),
            run(modes[2], 2, [500.0, 500.0], [55.0, 56.0], 120.0),
            {"spec": packing_plan.Spec("kernels", modes[1], 1, "turns N=1"), "skipped": "budget (9 s needed)"}]
    bases = packing_report.evaluate(runs, {})
    lines = packing_report.mode_table(runs, ["kernels"], bases).splitlines()
    assert lines[0] == ("| workload, N | no limiter: aggregate, pods' shares"
                        " | timeslice, caps floor(90/N)%: aggregate, pods' shares (charged)"
                        " | turns of 5 ms, caps floor(90/N)%: aggregate, pods' shares (charged)"
                        " | corun, equal weights: aggregate, pods' shares (charged), split |")
    assert lines[2] == "| kernels, 1 | 100% (1,000.0 kernels/s) |  | skipped |  |"
    # The turns pods' shares are judged as the time-sliced ones': 47% is
    # 2 pp past the cap of 45%, in bold.
    assert lines[3] == ("| kernels, 2 | 90.0%, 45.00% | 89.0%, 44.00–45.00% (44.10–45.00)"
                        " | 90.0%, **43.00–47.00%** (43.00–47.00) | 100.0%, 50.00% (55.00–56.00), 120% |")


def test_packing_returns_figures():
    def histogram(fast, slow):
        return {"buckets": [(0.001, fast), (0.002, fast + slow), (math.inf, fast + slow)],
                "sum": 0.0005 * fast + 0.0015 * slow, "count": fast + slow, "timeouts": 0}

    before = {"t": 10.0, "cpu_s": 1.0, "rss_mib": 30.0, "admission": histogram(0, 0), "charged_ns": {}}
    after = {"t": 15.0, "cpu_s": 1.1, "rss_mib": 31.0, "admission": histogram(0, 2), "charged_ns": {}}
    back = {"t": 17.0, "cpu_s": 1.14, "rss_mib": 31.0, "admission": histogram(98, 2), "charged_ns": {}}
    figures = packing_daemon.returns_figures(before, after, back)
    assert figures["cpu_pct"] == pytest.approx(2.0)
    assert figures["admission"]["requests"] == 98 and figures["admission"]["p99_ms"] == pytest.approx(0.99 * 98 / 98)
    both = figures["admission_with_window"]
    assert both["requests"] == 100 and 1.0 < both["p99_ms"] <= 2.0
    assert packing_daemon.returns_figures({**before, "admission": None}, after, back)["admission_with_window"] is None
    assert packing_plan.returns_phase(packing_plan.Spec("infer", packing_plan.MODES["corun"], 8, "corun N=8"), [1, 8])
    assert not packing_plan.returns_phase(packing_plan.Spec("infer", packing_plan.UNLIMITED, 8, "x"), [1, 8])
    assert not packing_plan.returns_phase(packing_plan.Spec("infer", packing_plan.MODES["corun"], 4, "x"), [4, 8])


def test_packing_daemon_figures_over_a_window():
    before = {"t": 10.0, "cpu_s": 1.0, "rss_mib": 30.0, "admission": None,
              "charged_ns": {"p-0": 1_000_000_000, "p-1": None}}
    after = {"t": 15.0, "cpu_s": 1.1, "rss_mib": 31.5, "admission": None,
             "charged_ns": {"p-0": 1_250_000_000, "p-1": 5}, "capacity_pct": 112.5}
    figures = packing_daemon.daemon_figures(before, after)
    assert figures["cpu_pct"] == pytest.approx(2.0) and figures["rss_mib"] == 31.5
    assert figures["charged_pct"] == {"p-0": pytest.approx(5.0)} and figures["admission"] is None
    assert figures["capacity_pct"] == 112.5


@corun_built
def test_packing(corun_env, monkeypatch, capsys):
    bundle, out, args = corun_env
    path = Path(os.environ["PATH"].split(":")[0])
    (path / "packing_infer.py").symlink_to(FAKE)
    monkeypatch.setattr(packing, "INFER", path / "packing_infer.py")
    monkeypatch.setattr(packing_daemon, "SIMULATE", "1")
    monkeypatch.setattr(packing, "START_S", 0.1)
    # NVML's utilisation from the window's start (the fake's 42%), sampled
    # often enough for a 0.3 s window.
    monkeypatch.setattr(packing, "NVML_FROM_S", 0.0)
    monkeypatch.setattr(packing, "SAMPLE_MS", 20)
    # A CUPTI to build against: its header and library where the bench
    # looks ($CUPTI_HOME); the fake nvcc "builds" kernel_time.so, and the
    # fake infer worker given it says how long its kernels ran.
    cupti = out.parent / "cupti"
    (cupti / "include").mkdir(parents=True)
    (cupti / "lib64").mkdir()
    (cupti / "include" / "cupti_activity.h").write_text("")
    (cupti / "lib64" / "libcupti.so.13").write_text("")
    monkeypatch.setenv("CUPTI_HOME", str(cupti))
    main(["packing", "--bundle", str(bundle), "--out", str(out), "--seconds", "0.3", "--counts", "1,2",
          "--modes", "timeslice,turns,corun", "--turn-ms", "3", "--mps-control", args[-1]])
    printed = capsys.readouterr().out
    assert "kernels calibrated: {'result': '1', 'iters': '1000'" in printed, printed
    assert "modes ['timeslice', 'turns', 'corun'] (turns of 3 ms)" in printed, printed
    text = (out / "packing-bench.md").read_text()
    assert "failed" not in text and "skipped" not in text and "not every worker was registered" not in text, text
    for workload in ("kernels", "infer"):
        for label in ("solo", "no limiter N=2", "timeslice N=1", "timeslice N=2", "turns N=1", "turns N=2",
                      "corun N=2", "solo again"):
            assert f"| {workload} | {label} |" in text, (workload, label, text)
    # The fakes run at their lone rate whatever the limits (nothing here
    # limits them): every figure is the plumbing's, from the workers' lines,
    # the fake nvidia-smi and the daemon's status, the GPU time charged
    # included (none). The kernels' shares are their throughput against
    # NVML's utilisation of the lone runs' windows (42%), which caps their
    # targets; the inference pods' are the time their kernels ran by CUPTI
    # (40% each), and the lone runs' (40%) caps their targets; the
    # warm-up's reading (0.21 ms steps: 84%), NVML's and the GPU time the
    # steps took in the window (gpu_busy) are notes beside it.
    assert f"kernel timing: {cupti / 'lib64' / 'libcupti.so.13'}" in printed, printed
    for mode in ("timeslice", "turns"):
        assert (f"| kernels | {mode} N=2 | cap 42.00% | 4,000.0 kernels/s | 200.0 | 42.00–42.00 | 0.00–0.00 |"
                in text), text
        assert f"| infer | {mode} N=2 | cap 40.00% | 8,000.0 steps/s | 200.0 | 40.00–40.00 |" in text, text
    assert ("infer alone: 4,000.0, 4,000.0 steps/s, drift +0.00%; CUPTI baseline 40.0%, warm-up baseline 84.0%"
            " (a step 0.210 ms on the GPU alone), NVML baseline 42.0%: baseline used: CUPTI; busy by its steps'"
            " events in the window: 90.0%") in text, text
    assert ("infer, each pod's kernels by CUPTI, % of the window (their sum), and its share by throughput: solo"
            " 40.00 (sum 40.0); no limiter N=2 40.00 (sum 80.0), by throughput 40.00;") in text, text
    assert "solo 5.0% (7,000) / 2.0% / 1.0%; solo again 5.0% (7,000) / 2.0% / 1.0%" in text, text
    assert "kernels alone: 2,000.0, 2,000.0 kernels/s, drift +0.00%; warm-up baseline 90.0% (a kernel" in text
    assert "| infer | solo | the baseline (GPU 40.0% busy, by CUPTI) |" in text
    assert "| kernels | solo | the baseline (GPU 42.0% busy, by NVML) |" in text
    # The table by mode: a column for each, the turns' as the time-sliced one's.
    assert ("| kernels, 2 | 200.0%, 42.00% | 200.0%, 42.00% (0.00) | 200.0%, 42.00% (0.00)"
            " | 200.0%, 42.00% (0.00)") in text, text
    assert "| turns of 3 ms, caps floor(90/N)%: aggregate, pods' shares (charged) |" in text
    # The turns runs' daemon had GPU 0 take turns of --turn-ms (its status
    # says so); the fakes launch nothing, so no turn is handed over.
    assert "kernels, turns (the status's turn, handovers in the window): turns N=2 3 ms, 0 (0/s); turns N=1 3 ms," \
        in text, text
    data = json.loads((out / "packing-bench.json").read_text())
    assert data["baselines"]["infer"] == {"per_s": 4000.0, "busy": pytest.approx(0.4), "by": "cupti",
                                          "cupti": pytest.approx(0.4), "nvml": 0.42, "warmup": pytest.approx(0.84),
                                          "unit_ms": pytest.approx(0.21)}
    # By CUPTI where the pods launch one at a time (one pod, or turns).
    assert {(r["label"], r["figures"]["by"]) for r in data["runs"] if r["workload"] == "infer" and r["n"] > 1} == {
        ("no limiter N=2", "throughput"), ("timeslice N=2", "throughput"), ("turns N=2", "cupti"),
        ("corun N=2", "throughput")}
    assert {r["figures"]["by"] for r in data["runs"] if r["workload"] == "infer" and r["n"] == 1} == {"cupti"}
    assert {r["figures"]["by"] for r in data["runs"] if r["workload"] == "kernels"} == {"throughput"}
    for run in data["runs"]:
        # The runs with the most pods end with returns: each fake worker
        # asks for admission once a return, and the daemon's histogram
        # counts them.
        back = run["result"].get("returns")
        if run["mode"] in ("timeslice", "turns", "corun") and run["n"] == 2:
            assert back["pods_through"] == 2 and back["admission"]["requests"] == 2 * packing_plan.RETURNS, back
            assert back["admission_with_window"]["requests"] == 2 * packing_plan.RETURNS, back
        else:
            assert back is None, run
        turns = (run["result"].get("daemon") or {}).get("turns")
        assert run["turn_ms"] == (3 if run["mode"] == "turns" else None), run
        assert turns == ({"turn_ms": 3.0, "handovers": 0, "handovers_per_s": 0.0} if run["mode"] == "turns"
                         else None), run
    corun2 = next(r for r in data["runs"] if r["workload"] == "kernels" and r["label"] == "corun N=2")
    assert corun2["result"]["registered"] and set(corun2["result"]["daemon"]["charged_pct"]) == {
        f"{corun2['result']['tag']}-0", f"{corun2['result']['tag']}-1"}
