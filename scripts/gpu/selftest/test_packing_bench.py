"""The packing bench (python3 -m scripts.bench packing) without a GPU: its
plan, figures and verdicts from known inputs, its kernel timing's build,
and a dry run against fakebench.py with the real daemon (--simulate-gpus)
and the fake MPS control daemon when target/ has them built."""

import json
import math
import os
from pathlib import Path

import pytest

from bench_fixtures import FAKE, corun_built, corun_env, fakes  # noqa: F401 (fixtures)
from scripts.bench import packing, packing_daemon, packing_plan, packing_report
from scripts.bench.__main__ import main, parser
from scripts.gpu.e2e.harness import smi


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
    # turns of --turn-ms (with --modes).
    turns = packing_plan.MODES["turns"]
    assert (turns.daemon, turns.corun, turns.policy, turns.turn_ms) == (True, False, "fixed", packing_plan.TURN_MS)
    assert all(m.turn_ms is None for name, m in packing_plan.MODES.items() if name not in ("turns", "auto"))
    # The daemon's default: turns by itself, of the same length; the
    # default modes run it between the others.
    auto = packing_plan.MODES["auto"]
    assert (auto.daemon, auto.corun, auto.policy, auto.turn_ms, auto.auto) == (
        True, False, "fixed", packing_plan.TURN_MS, True)
    assert not turns.auto
    top, _ = parser()
    a = top.parse_args(["packing", "--bundle", "b"])
    assert (a.modes, a.turn_ms) == (["timeslice", "auto", "corun"], 10)
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
    assert timeslice.serve_args == ["--no-auto-turns"]
    auto = packing_plan.with_turn_ms([packing_plan.MODES["auto"]], 7)[0]
    assert packing_daemon.PackingDaemon(*args, auto, ["p-0", "p-1"], "mps-control").serve_args == ["--turn-ms", "7"]
    # GPU 0's turns from the status; the handovers over a window.
    status = {"turns": [{"gpu": "GPU-a", "index": 0, "takes_turns": True, "quantum_us": 7000, "handovers": 40},
                        {"gpu": "GPU-b", "index": 1, "takes_turns": False, "quantum_us": 0, "handovers": 0}]}
    assert packing_daemon.gpu_turns(status) == {"quantum_us": 7000, "handovers": 40}
    assert packing_daemon.gpu_turns({"turns": status["turns"][1:]}) is None and packing_daemon.gpu_turns({}) is None
    # One that takes turns by itself, not yet: its count so far.
    idle = {"turns": [{"gpu": "GPU-a", "index": 0, "takes_turns": False, "automatic": True, "quantum_us": 0,
                       "handovers": 12}]}
    assert packing_daemon.gpu_turns(idle) == {"quantum_us": 0, "handovers": 12}
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
    # The lone process's kernels ran 90% and 92% of its windows by CUPTI,
    # and the GPU moved between its queued kernels 4% more: the baseline
    # is their sum, before NVML's 99%.
    runs = [lone_run(4000.0, 99.0, 0.21, ran=0.90), lone_run(4000.0, 99.0, 0.21, "solo again", 0.92),
            lone_run(4000.0, 99.0, 0.21, "solo once more")]
    base = packing_report.baseline(runs, "infer", {})
    assert (base["by"], base["busy"], base["cupti"], base["nvml"]) == (
        "cupti", pytest.approx(0.95), pytest.approx(0.95), pytest.approx(0.99))
    assert packing_report.baseline([lone_run(4000.0, 99.0)], "infer", {})["by"] == "nvml"
    # A pod's GPU time: its kernels and the moves between them, or none
    # where CUPTI gave either alone.
    assert packing_report.gpu_time({"kernel_busy": 0.4, "gaps_3us": 0.02}) == pytest.approx(0.42)
    assert packing_report.gpu_time({"kernel_busy": 0.4}) is None and packing_report.gpu_time({}) is None
    # Pods that CUPTI timed, every one: their shares are their GPU time;
    # one without it: all by throughput.
    spec = packing_plan.Spec("infer", packing_plan.MODES["turns"], 2, "turns N=2")
    pods = [{"per_s": 1900.0, "kernel_busy": 0.432, "gaps_3us": 0.02, "host_wait": 0.41, "launch_us": 120.5},
            {"per_s": 1800.0, "kernel_busy": 0.426, "gaps_3us": 0.02, "host_wait": 0.02, "launch_us": 310.0}]
    runs.append({"spec": spec, "result": {"tag": "t", "pods": pods,
                                          "daemon": {"forfeited_pct": {"t-0": 0.31, "t-1": 0.02}}}})
    bases = packing_report.evaluate(runs, {})
    fig = runs[-1]["figures"]
    assert fig["by"] == "cupti" and fig["shares"] == pytest.approx([45.2, 44.6]) and fig["targets"] == [45.0, 45.0]
    assert fig["max_dev_pp"] == pytest.approx(-0.4) and fig["verdicts"] == {"shares": True}
    notes = packing_report.notes(runs, ["infer"], bases)
    [line] = [x for x in notes if x.startswith("infer, each pod's GPU time")]
    assert line.endswith("; turns N=2 44.60–45.20 (sum 89.8; kernels 42.60–43.20), by throughput 42.75–45.12"), line
    assert "infer, budget forfeited at the bucket's depth, % of the window: turns N=2 0.02–0.31" in notes
    runs[-1]["result"]["daemon"]["forfeited_pct"] = {"t-0": 0.04, "t-1": 0.0}
    assert not [x for x in packing_report.notes(runs, ["infer"], bases) if "forfeited" in x]
    # Its pods' host loops: only the run whose every pod timed its own.
    assert ("infer, each pod's thread waiting for its steps, % of the window, and launching a step:"
            " turns N=2 2.00–41.00%, 120.50–310.00 us") in notes
    del pods[1]["launch_us"]
    assert not [x for x in packing_report.notes(runs, ["infer"], bases) if "waiting for its steps" in x]
    assert ("infer alone, the GPU idle between its kernels by CUPTI, % of the window, in gaps up to 3 us (how many)"
            " / 3 to 10 us / longer: solo 4.0% (9,000) / 0.5% / 0.2%; solo again 4.0% (9,000) / 0.5% / 0.2%") in notes
    # Time-sliced pods launching at once: by throughput, CUPTI's beside it.
    runs[-1]["spec"] = packing_plan.Spec("infer", packing_plan.MODES["timeslice"], 2, "timeslice N=2")
    packing_report.evaluate(runs, {})
    assert runs[-1]["figures"]["by"] == "throughput"
    runs[-1]["spec"] = spec
    del pods[1]["gaps_3us"]
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
             "charged_ns": {"p-0": 1_250_000_000, "p-1": 5}, "capacity_pct": 112.5,
             "forfeited_ns": {"p-0": 50_000_000, "p-1": 7}}
    figures = packing_daemon.daemon_figures(before, after)
    assert figures["cpu_pct"] == pytest.approx(2.0) and figures["rss_mib"] == 31.5
    assert figures["charged_pct"] == {"p-0": pytest.approx(5.0)} and figures["admission"] is None
    # Forfeits only where both readings have them: none before here.
    assert figures["forfeited_pct"] == {}
    before["forfeited_ns"] = {"p-0": 0, "p-1": None}
    assert packing_daemon.daemon_figures(before, after)["forfeited_pct"] == {"p-0": pytest.approx(1.0)}
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
    # targets; the inference pods' are their GPU time by CUPTI (kernels 40%
    # and moves 5% each), and the lone runs' (45%) caps their targets; the
    # warm-up's reading (0.21 ms steps: 84%), NVML's and the GPU time the
    # steps took in the window (gpu_busy) are notes beside it.
    assert f"kernel timing: {cupti / 'lib64' / 'libcupti.so.13'}" in printed, printed
    for mode in ("timeslice", "turns"):
        assert (f"| kernels | {mode} N=2 | cap 42.00% | 4,000.0 kernels/s | 200.0 | 42.00–42.00 | 0.00–0.00 |"
                in text), text
        assert f"| infer | {mode} N=2 | cap 45.00% | 8,000.0 steps/s | 200.0 | 45.00–45.00 |" in text, text
    assert ("infer alone: 4,000.0, 4,000.0 steps/s, drift +0.00%; CUPTI baseline 45.0%, warm-up baseline 84.0%"
            " (a step 0.210 ms on the GPU alone), NVML baseline 42.0%: baseline used: CUPTI; busy by its steps'"
            " events in the window: 90.0%") in text, text
    assert ("infer, each pod's GPU time by CUPTI (kernels and the moves between its queued kernels), % of the window"
            " (their sum; kernels alone; laid over each other: the GPU busy by any, the time counted twice, each pod's"
            " time alone and split where they overlap), and its share by throughput: solo 45.00 (sum 45.0; kernels"
            " 40.00); no limiter N=2 45.00 (sum 90.0; kernels 40.00), by throughput 45.00;") in text, text
    assert "solo 5.0% (7,000) / 2.0% / 1.0%; solo again 5.0% (7,000) / 2.0% / 1.0%" in text, text
    assert "kernels alone: 2,000.0, 2,000.0 kernels/s, drift +0.00%; warm-up baseline 90.0% (a kernel" in text
    assert "| infer | solo | the baseline (GPU 45.0% busy, by CUPTI) |" in text
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
    assert data["baselines"]["infer"] == {"per_s": 4000.0, "busy": pytest.approx(0.45), "by": "cupti",
                                          "cupti": pytest.approx(0.45), "nvml": 0.42, "warmup": pytest.approx(0.84),
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
