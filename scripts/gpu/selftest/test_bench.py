"""The benchmarks (python3 -m scripts.bench) without a GPU: every subcommand
parses its options; they use the GPU check's harness (its sampler,
statistics, process runs and daemon), not copies of their own; and each runs
through against fakebench.py (nvidia-smi, nvcc, compute_bench, the workers,
torch_workloads.py), the co-run ones with the real daemon (--simulate-gpus)
and the fake MPS control daemon when target/ has them built. The packing
bench's are in test_packing_bench.py."""

import inspect
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

from scripts.bench import common, compute, corun, corun_ab, corun_frontier, launch, priority  # noqa: E402
from scripts.bench.__main__ import SUBCOMMANDS, main, parser  # noqa: E402
from scripts.gpu.e2e.harness import hv, parse, proc, smi  # noqa: E402

from bench_fixtures import corun_built, corun_env, fakes  # noqa: E402,F401 (fixtures)


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
