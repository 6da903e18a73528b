"""The serve bench (python3 -m scripts.bench serve) without a GPU: its
options, the trace (Zipf popularity, Poisson arrivals, seeded), the
percentiles and a load's figures, the plan from the GPU's and the host's
memory, the daemon's config and a refused key, the report, a run against
stand-in pods that answer as the serve pods do, and the dry run."""

import contextlib
import json
import math
import os
import statistics
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # python3 -m pytest from elsewhere than the repository root
    sys.path.append(str(REPO))

from builds import built  # noqa: E402
from test_swap_bench import fake_smi  # noqa: E402
from scripts.bench import serve, serve_plan, serve_report, serve_run, serve_trace, swap_bench  # noqa: E402
from scripts.bench.__main__ import SUBCOMMANDS, main, parser  # noqa: E402
from scripts.gpu.e2e.harness import parse  # noqa: E402

GIB, MIB = swap_bench.GIB, swap_bench.MIB
H200 = 143771 * MIB


def test_entry_point_options_and_defaults(tmp_path):
    top, subs = parser()
    assert SUBCOMMANDS["serve"][1] is serve.__doc__ and subs["serve"].description == serve.__doc__
    assert serve_trace.percentile is parse.percentile
    a = top.parse_args(["serve", "--dry-run", "--out", str(tmp_path / "o")])
    assert (a.sizes, a.weights, a.loads, a.duration, a.zipf, a.seed, a.path, a.baseline, a.budget_s) == (
        [4, 8, 12, 16], 12.0, [2.0, 4.0, 8.0], 12.0, 1.0, 1, "fast", "largest", 540)
    serve.resolve(subs["serve"], a)
    # The headroom: one pod's 12 GiB of weights and its context; the
    # policy's keys as the daemon's config writes them.
    assert a.weight_bytes == 12 * GIB and a.headroom_bytes == 13 * GIB and (tmp_path / "o").is_dir()
    assert a.keys == {"headroom": '"13g"', "min_resident_ms": "250"} and a.idle_after_ms == 200
    a = top.parse_args(["serve", "--dry-run", "--out", str(tmp_path / "p"), "--sizes", "2,16", "--loads", "0.5,4",
                        "--headroom", "none", "--min-resident-ms", "none", "--swap-key", "min_resident = '2s'",
                        "--swap-key", "headroom=3", "--weights", "1.3", "--path", "checkpoint"])
    serve.resolve(subs["serve"], a)
    assert (a.sizes, a.loads, a.path, a.headroom_bytes) == ([2, 16], [0.5, 4.0], "checkpoint", None)
    # Weights in whole layers of 128 MiB; the keys given verbatim.
    assert a.weight_bytes == 10 * 128 * MIB and a.keys == {"min_resident": "'2s'", "headroom": "3"}
    for argv in (["--sizes", "4,0"], ["--loads", "x"], ["--swap-key", "headroom"], ["--swap-key", "a b=1"],
                 ["--swap-key", "k=not toml"], ["--headroom", "-1"], ["--path", "both"]):
        with pytest.raises(SystemExit):
            top.parse_args(["serve", "--dry-run", *argv])
    with pytest.raises(SystemExit):  # a run needs the bundle
        serve.resolve(subs["serve"], top.parse_args(["serve", "--out", str(tmp_path / "q")]))
    with pytest.raises(SystemExit):  # one without its daemon
        serve.resolve(subs["serve"], top.parse_args(["serve", "--bundle", str(tmp_path)]))


def test_trace_is_zipf_and_poisson_from_its_seed():
    assert serve_trace.zipf(4, 1.0) == pytest.approx([12 / 25, 6 / 25, 4 / 25, 3 / 25])
    assert serve_trace.zipf(3, 0.0) == pytest.approx([1 / 3] * 3)
    shares = serve_trace.popularity(16, 1.0, "s")
    # The Zipf ranks dealt to the pods in the seed's order, every time.
    assert sorted(shares, reverse=True) == pytest.approx(serve_trace.zipf(16, 1.0))
    assert shares == serve_trace.popularity(16, 1.0, "s") != serve_trace.popularity(16, 1.0, "t")
    requests = serve_trace.trace(shares, 1000.0, 10.0, 8, "seed")
    assert requests == serve_trace.trace(shares, 1000.0, 10.0, 8, "seed")
    assert requests != serve_trace.trace(shares, 1000.0, 10.0, 8, "other")
    assert [r.id for r in requests] == list(range(len(requests)))
    assert all(0 < r.at < 10 for r in requests) and {r.input for r in requests} == set(range(8))
    # Poisson: about rate x seconds arrivals, exponential gaps (mean and
    # standard deviation 1/rate); each pod's count about its share.
    assert abs(len(requests) - 10000) < 400
    gaps = [b.at - a.at for a, b in zip(requests, requests[1:])]
    assert statistics.mean(gaps) == pytest.approx(1e-3, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(1e-3, rel=0.08)
    for pod, share in enumerate(shares):
        count = sum(1 for r in requests if r.pod == pod)
        assert abs(count - share * len(requests)) < 5 * math.sqrt(share * len(requests)) + 5
    assert serve_trace.trace([1.0], 5.0, 0.0, 8, "x") == []
    assert serve_trace.trace_seed(1, 16, 2) == "serve-1-16-2" != serve_trace.trace_seed(1, 12, 2)


def test_percentiles_with_unanswered_requests():
    q = serve_trace.quantile
    assert q([0.4, 0.1, 0.3, 0.2], 0.5) == pytest.approx(0.25) and q([0.1], 0.99) == 0.1
    # An unanswered request is longer than any answer: the quantiles that
    # reach it never end.
    assert q([0.1, 0.2, 0.3], 0.5, unanswered=1) == pytest.approx(0.25)
    assert q([0.1, 0.2, 0.3], 0.99, unanswered=1) == math.inf and q([], 0.5, unanswered=2) == math.inf
    assert q([0.1, 0.2], 0.0, unanswered=1) == 0.1 and q([0.1], 1.0, unanswered=1) == math.inf
    assert math.isnan(q([], 0.5))


def rows(latencies, **over):
    return [{"at": 0.1 * i, "latency_s": x, "ok": x is not None, "oom": False, "identical": True, **over}
            for i, x in enumerate(latencies)]


def test_load_figures_and_bounds():
    ok = serve_trace.figures(rows([0.01 * (i + 1) for i in range(100)]), seconds=10.0)
    assert ok == {"requests": 100, "answered": 100, "unanswered": 0, "failed": 0, "oom": 0, "different": 0,
                  "p50_s": pytest.approx(0.505), "p95_s": pytest.approx(0.9505), "p99_s": pytest.approx(0.9901),
                  "throughput": pytest.approx(100 / 10.9)}  # the last answer at 9.9 + 1.0 s
    assert serve_trace.shortfalls(ok) == ["p50 > 0.5 s"]
    fast = serve_trace.figures(rows([0.2] * 50), seconds=10.0)
    assert serve_trace.shortfalls(fast) == [] and fast["throughput"] == 5.0
    bad = rows([0.2] * 10) + rows([None]) + rows([0.3], ok=False, oom=True) + rows([0.1], ok=False)
    bad += rows([0.2], identical=False)
    f = serve_trace.figures(bad, seconds=1.0)
    counts = (f["requests"], f["answered"], f["unanswered"], f["failed"], f["oom"], f["different"])
    assert counts == (14, 13, 1, 2, 1, 1)
    assert serve_trace.shortfalls(f) == ["1 unanswered", "1 out of memory", "1 failed", "1 answers differ",
                                         "p99 > 1.5 s"]
    assert serve_trace.shortfalls(serve_trace.figures([], 1.0)) == ["no request", "p50 > 0.5 s", "p99 > 1.5 s"]
    runs = [{"pods": 4, "loads": [{"figures": fast}]}, {"pods": 8, "loads": [{"figures": fast}, {"figures": ok}]},
            {"pods": 12, "loads": [{"figures": fast}], "failed": "the budget spent"}, {"pods": 16, "loads": []}]
    assert serve_trace.highest_served(runs) == 4 and serve_trace.highest_served(runs[1:]) is None
    over = dict(fast, turned_over=True)
    turning = [{"pods": 8, "loads": [{"rate": 2.0, "figures": fast}, {"rate": 4.0, "figures": over}]},
               {"pods": 12, "loads": [{"rate": 2.0, "figures": over}, {"rate": 8.0, "figures": dict(ok, turned_over=True)}],
                "failed": "the budget spent"},
               {"pods": 16, "loads": [{"rate": 2.0, "figures": fast}, {"rate": 8.0, "figures": dict(ok, turned_over=True)}]}]
    # 16 met the bounds only where nothing turned over, and failed where it
    # did; 12 met them at 2 req/s with the set turning over, though it
    # fails at 8 and did not finish.
    assert serve_trace.highest_turning_over(turning) == (12, [2.0])
    assert serve_trace.highest_turning_over(turning[:1]) == (8, [4.0])
    assert serve_trace.highest_turning_over(turning[2:]) is None


def test_plan_on_an_h200():
    runs = serve_plan.runs([4, 8, 12, 16], 12 * GIB, H200, 118 * GIB, 13 * GIB, "largest", 3, 12.0, "fast")
    assert [(r.pods, r.kind) for r in runs] == [(16, "overcommit"), (12, "overcommit"), (8, "overcommit"),
                                                (4, "overcommit"), (8, "baseline")]
    # Fast path: every context stays on the GPU; 16 pods leave room for 9
    # models beside 13 GiB of headroom, 7 swapped, 84 GiB on the host of
    # the 118 - 16 x 1.5 - 8 = 86 GiB of host_limit.
    big = runs[0]
    assert (big.quota, big.swapped_at_start, big.host_limit, big.skip, big.warning) == (
        14 * GIB, 7, 86 * GIB, None, None)
    assert big.estimate_s == 20 + 16 + 7 + 3 * 15 + 10
    assert [r.swapped_at_start for r in runs] == [7, 3, 0, 0, 0] and runs[-1].host_limit == 0
    # Every context stays on the GPU on the fast path, swapped or not; the
    # checkpoint takes it along: 32 pods of 4 GiB, 27 resident against 28.
    assert serve_plan.resident_room(32, 4 * GIB, H200, 0, "fast") == (H200 - 32 * GIB) // (4 * GIB) == 27
    assert serve_plan.resident_room(32, 4 * GIB, H200, 0, "checkpoint") == H200 // (5 * GIB) == 28
    # The checkpoint moves the contexts too: 9 of 13 GiB resident.
    slow = serve_plan.runs([16], 12 * GIB, H200, 118 * GIB, 13 * GIB, "none", 1, 10.0, "checkpoint")
    assert [(r.swapped_at_start, r.estimate_s) for r in slow] == [(7, 20 + 16 + 56 + 13 + 10)]
    assert "7 pods swapped need about 91 GiB of host memory, more than the 86 GiB of host_limit" in slow[0].warning
    # Every count that fits for --baseline all; a pod too large is not run.
    assert [r.pods for r in serve_plan.runs([4, 8, 12], 12 * GIB, H200, 118 * GIB, 0, "all", 1, 1.0, "fast")
            if r.kind == "baseline"] == [8, 4]
    huge = serve_plan.runs([2], 100 * GIB, H200, 500 * GIB, 40 * GIB, "largest", 1, 1.0, "fast")
    assert [(r.kind, r.skip) for r in huge] == [("overcommit", "one pod's 101 GiB and a headroom of 40 GiB do not fit"
                                                               " the GPU's 140.4 GiB free")]


def test_swap_keys_and_the_daemon_config():
    assert serve_plan.size_text(13 * GIB) == "13g" and serve_plan.size_text(1536 * MIB) == "1536m"
    assert serve_plan.swap_keys(None, None) == {}
    keys = serve_plan.swap_keys(13 * GIB, 2000, [("min_resident_ms", "500"), ("queue", '"fifo"')])
    assert keys == {"headroom": '"13g"', "min_resident_ms": "500", "queue": '"fifo"'}
    for bad in ("headroom", "=1", "a.b=1", "k=[1", "k="):
        with pytest.raises(ValueError):
            serve_plan.extra_key(bad)
    assert serve_plan.extra_key(" k = 'v' ") == ("k", "'v'")
    args = SimpleNamespace(idle_after_ms=1000, keys=keys)
    run = serve_plan.Run(2, "overcommit", 14 * GIB, 86 * GIB, 0, 1.0)
    config = tomllib.loads(serve.config_of(args, run))
    assert config["swap"] == {"overcommit": True, "idle_after_ms": 1000, "latency_pods": "last", "host_limit": 86 * GIB,
                              "room_wait_ms": 120000, "headroom": "13g", "min_resident_ms": 500, "queue": "fifo"}
    assert [(p["id"], p["gpus"]) for p in config["pods"]] == [
        ("serve2-00", [{"index": 0, "memory": 14 * GIB}]), ("serve2-01", [{"index": 0, "memory": 14 * GIB}])]
    # The baseline: overcommit off, no policy keys.
    base = tomllib.loads(serve.config_of(args, serve_plan.Run(2, "baseline", 14 * GIB, 0, 0, 1.0)))
    assert base["swap"] == {"overcommit": False, "idle_after_ms": 1000, "latency_pods": "last", "host_limit": GIB,
                            "room_wait_ms": 120000}


def fake_daemon(folder, said):
    program = folder / "hypervisor"
    program.write_text(f"#!/bin/sh\necho {said!r} >&2\nexit 1\n")
    program.chmod(0o755)
    return program


def test_a_refused_key_is_named(tmp_path):
    said = ("hypervisor: c.toml: TOML parse error at line 10, column 1: unknown field `headroom`, expected one of"
            " `overcommit`, `idle_after_ms`")
    with pytest.raises(swap_bench.BenchError) as e:
        serve.check_config(fake_daemon(tmp_path, said), tmp_path / "c.toml", "[swap]\n")
    assert str(e.value).startswith(f"the daemon {tmp_path / 'hypervisor'} refuses [swap] headroom: it does not know the"
                                   " key (a build without the serving policy?); use a bundle that has it, or run with"
                                   " --headroom none. It said: hypervisor: c.toml")
    with pytest.raises(swap_bench.BenchError, match="refuses the config .*: bad port"):
        serve.check_config(fake_daemon(tmp_path, "bad port"), tmp_path / "c.toml", "")


@pytest.mark.skipif(not built("hypervisor"), reason="needs the daemon built (builds.py)")
def test_the_daemon_checks_the_config(tmp_path):
    """This build's daemon: a key it does not know refused and named, the
    config without it taken."""
    args = SimpleNamespace(idle_after_ms=1000, keys={"no_such_key": "1"})
    run = serve_plan.Run(2, "overcommit", 14 * GIB, 86 * GIB, 0, 1.0)
    with pytest.raises(swap_bench.BenchError, match=r"refuses \[swap\] no_such_key: .* or run with no --swap-key"
                                                    r" no_such_key=\.\.\."):
        serve.check_config(built("hypervisor"), tmp_path / "c.toml", serve.config_of(args, run))
    args.keys = {}
    serve.check_config(built("hypervisor"), tmp_path / "c.toml", serve.config_of(args, run))


def figures_of(**over):
    return {"requests": 100, "answered": 100, "unanswered": 0, "failed": 0, "oom": 0, "different": 0, "p50_s": 0.0123,
            "p95_s": 0.4, "p99_s": 1.2, "throughput": 7.987, "swap_ins_per_s": 0.75, "swap_outs_per_s": 0.5,
            "turned_over": True, "resident_mean": 9.25, "gpu_used_max": 130 * GIB, "host_swapped_max": 84 * GIB,
            "host_kept_max": 12 * GIB, **over}


def test_report_rows_and_verdict():
    runs = [
        {"pods": 16, "kind": "overcommit", "path": "fast", "loads": [
            {"rate": 2.0, "figures": figures_of()},
            {"rate": 16.0, "figures": figures_of(p99_s=math.inf, unanswered=1, answered=99, turned_over=False,
                                                 host_kept_max=None)}],
         "failed": "1 requests unanswered at 16 req/s"},
        {"pods": 8, "kind": "baseline", "path": "fast", "loads": [
            {"rate": 2.0, "figures": figures_of(swap_ins_per_s=0.0, swap_outs_per_s=0.0, turned_over=False,
                                                resident_mean=None, host_swapped_max=None, host_kept_max=None)}]},
        {"pods": 8, "kind": "overcommit", "path": "fast", "loads": [{"rate": 2.0, "figures": figures_of()}]},
        {"pods": 4, "kind": "overcommit", "path": "fast", "loads": [], "skipped": "about 79 s needed, 50 s left"},
    ]
    empty = "  |" * 10
    assert serve_report.report(runs, []) == serve_report.HEAD + (
        f"| 4 | fast path |{empty} not run: about 79 s needed, 50 s left |\n"
        "| 8 | fast path | 2 | 100 (100) | 0.012 / 0.400 / 1.200 | 7.99 | 0.75 / 0.50, turned over | 9.2 | 130.0"
        " | 84.0 (12.0) | 0 | yes | PASS |\n"
        "| 8 | all resident (baseline) | 2 | 100 (100) | 0.012 / 0.400 / 1.200 | 7.99 | 0.00 / 0.00 | n/a | 130.0"
        " | n/a (n/a) | 0 | yes | PASS |\n"
        "| 16 | fast path | 2 | 100 (100) | 0.012 / 0.400 / 1.200 | 7.99 | 0.75 / 0.50, turned over | 9.2 | 130.0"
        " | 84.0 (12.0) | 0 | yes | PASS |\n"
        "| 16 | fast path | 16 | 100 (99) | 0.012 / 0.400 / never | 7.99 | 0.75 / 0.50 | 9.2 | 130.0 | 84.0 (n/a)"
        " | 0 | yes | FAIL: 1 unanswered, p99 > 1.5 s |\n"
        f"| 16 | fast path |{empty} FAILED: 1 requests unanswered at 16 req/s |\n"
        "\nHighest number of pods served (p99 <= 1.5 s and p50 <= 0.5 s at every load, no out-of-memory error, every"
        " request answered, answers identical): 8 (of 8, 16 run).\n"
        "Highest number of pods served at a load where the resident set turned over (the same bounds at that"
        " load): 16 (at 2 req/s).\n")
    assert serve_report.HEAD.count("|") == 2 * 14 and serve_report.HEAD.splitlines()[1] == "|---" * 13 + "|"
    text = serve_report.report([runs[0]], ["serve-16-baseline base16-03: model 1003 input 2: b where a was"])
    assert text.endswith(": none (of 16 run).\nHighest number of pods served at a load where the resident set"
                         " turned over (the same bounds at that load): 16 (at 2 req/s).\nModels' answers computed resident differ between runs:"
                         " serve-16-baseline base16-03: model 1003 input 2: b where a was\n")


STAND_IN = """\
import json, sys, time
size, seed, inputs = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def reply(**f):
    print("REPLY " + json.dumps(f), flush=True)
reply(ready=True, answers=[f"d{seed}-{i}" for i in range(inputs)])
for line in sys.stdin:
    words = line.split()
    if words[0] == "exit":
        reply(bye=True)
        break
    if seed == 1002:  # never answers: a pod stuck
        continue
    if seed == 1001:  # waits, as for its swap-in
        time.sleep(0.05)
    digest = f"d{seed}-{words[2]}" if seed != 1000 or words[2] != "3" else "changed"
    reply(req=int(words[1]), ok=True, s=0.001, digest=digest)
"""


class StandInBench:
    """The daemon's side of a run: stand-in pods for the serve pods, the
    daemon's totals counting up at each read."""

    def __init__(self, tmp_path, **args):
        self.args = SimpleNamespace(zipf=1.0, seed=3, loads=[40.0, 80.0], duration=0.3, drain_s=0.5, path="fast",
                                    idle_after_ms=1000, start_together=False, **args)
        self.tmp, self.deadline, self.pods, self.reads, self.served = tmp_path, time.monotonic() + 60, [], 0, []
        self.program = tmp_path / "stand_in.py"
        self.program.write_text(STAND_IN)

    def left(self):
        return self.deadline - time.monotonic()

    @contextlib.contextmanager
    def serving(self, part, quotas, idle_after_ms, host_limit=None, overcommit=True, extra=None):
        self.served.append((part, sorted(quotas), overcommit, extra))
        try:
            yield
        finally:
            for p in list(self.pods):
                self.stop_pod(p)

    def start_pod(self, pod, mode, *argv, route=None):
        assert mode == "serve"
        p = swap_bench.Pod(pod, [mode, *map(str, argv)], dict(os.environ), self.tmp / f"{pod}.log", self.program,
                           route)
        self.pods.append(p)
        return p

    def stop_pod(self, p):
        p.stop()
        self.pods.remove(p)

    def totals(self):
        self.reads += 1
        return {"swap_ins": 3 * self.reads, "swap_outs": 2 * self.reads, "swapped_pods": 1,
                "bytes_on_host": 12 * GIB, "host_kept_bytes": GIB}

    def metrics(self):
        return [f"gpushare_swap_ins_total {self.reads}", 'gpushare_swap_waits_total{cause="room"} 2', "# HELP x"]


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(serve_run, "gpu_memory", lambda: (H200, 100 * GIB, H200 - 100 * GIB))
    monkeypatch.setattr(serve_run, "host_available", lambda: 90 * GIB)
    monkeypatch.setattr(serve_run, "SAMPLE_S", 0.05)


def test_a_run_against_stand_in_pods(tmp_path, no_gpu, capsys):
    """Requests sent as they arrive, answers matched and timed, the model
    whose answer changed caught, every pod stopped."""
    b = StandInBench(tmp_path)
    run = serve_plan.Run(2, "overcommit", 14 * GIB, 86 * GIB, 0, 1.0)
    reference, result = serve_run.Reference(), {}
    serve_run.serve_run(b, run, 12 * GIB, reference, {"headroom": '"13g"'}, result)
    assert b.served == [("serve-2-overcommit", ["serve2-00", "serve2-01"], True, {"headroom": '"13g"'})]
    assert b.pods == [] and reference.conflicts == []
    assert reference.digests == {(1000 + p, i): f"d{1000 + p}-{i}" for p in (0, 1) for i in range(8)}
    assert [load["rate"] for load in result["loads"]] == [40.0, 80.0] and "failed" not in result
    for k, load in enumerate(result["loads"]):
        want = serve_trace.trace(result["shares"], load["rate"], 0.3, 8, serve_trace.trace_seed(3, 2, k))
        assert [(r["id"], r["pod"], r["input"]) for r in load["rows"]] == [
            (w.id, serve_run.pod_name(run, w.pod), w.input) for w in want]
        for row in load["rows"]:
            # Pod serve2-01 waits 50 ms before each answer (its requests queue).
            assert row["ok"] and 0 <= row["latency_s"] < 5 and row["sent_late_s"] < 0.5
            assert row["latency_s"] >= (0.05 if row["pod"] == "serve2-01" else 0)
            assert row["identical"] == (row["pod"] != "serve2-00" or row["input"] != 3)
        f = load["figures"]
        assert f["answered"] == f["requests"] == len(want) > 0 and f["unanswered"] == 0
        assert f["different"] == sum(1 for w in want if w.pod == 0 and w.input == 3)
        # The daemon's totals read before and after the load.
        assert load["totals"]["swap_ins"] > 0 and f["swap_ins_per_s"] == load["totals"]["swap_ins"] / 0.3
        assert load["metrics"] == {"gpushare_swap_ins_total": load["totals"]["swap_ins"] / 3,
                                   'gpushare_swap_waits_total{cause="room"}': 0.0}
        assert f["gpu_used_max"] == 100 * GIB and f["host_swapped_max"] == 12 * GIB and f["resident_mean"] == 1
    assert "serve-2-overcommit (fast path): 2 pods of 12 GiB (quota 14 GiB) ready in" in capsys.readouterr().out
    assert result["samples"] and len(result["pod_rss"]) == 2


def test_a_stuck_pod_ends_its_run(tmp_path, no_gpu):
    b = StandInBench(tmp_path)
    run = serve_plan.Run(3, "baseline", 14 * GIB, 0, 0, 1.0)
    result = {}
    serve_run.serve_run(b, run, 12 * GIB, serve_run.Reference(), {"headroom": '"13g"'}, result)
    # Pod base3-02 never answers: its requests are unanswered after the
    # drain, and the next load is not run; the baseline has no policy keys.
    assert b.served == [("serve-3-baseline", ["base3-00", "base3-01", "base3-02"], False, None)] and b.pods == []
    (load,) = result["loads"]
    stuck = [r for r in load["rows"] if r["pod"] == "base3-02"]
    assert stuck and all(r["latency_s"] is None for r in stuck)
    assert result["failed"] == f"{len(stuck)} requests unanswered at 40 req/s"
    assert load["figures"]["p99_s"] == math.inf


@pytest.mark.skipif(not built("hypervisor"), reason="needs the daemon built (builds.py)")
def test_a_call_on_the_daemon_with_stand_in_pods(tmp_path, monkeypatch, capsys):
    """The entry point's run: this build's daemon (--simulate-gpus, no
    NVML here) with the plan's config, stand-in pods, nvidia-smi a fake;
    the table and the rows written, the pods and the daemon stopped, no
    region left."""
    fake_smi(tmp_path, monkeypatch, {"memory.total,memory.used,memory.free": "143771, 500, 143271\n"})
    program = tmp_path / "stand_in.py"
    program.write_text(STAND_IN)
    monkeypatch.setattr(swap_bench, "POD_PROGRAM", program)
    monkeypatch.setattr(swap_bench, "SIMULATE", "1")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "libcuda_limiter.so").write_bytes(b"")
    (bundle / "hypervisor").symlink_to(built("hypervisor"))
    out = tmp_path / "out"
    assert main(["serve", "--bundle", str(bundle), "--out", str(out), "--sizes", "2", "--loads", "20", "--duration",
                 "0.4", "--baseline", "none", "--headroom", "none", "--min-resident-ms", "none", "--weights", "1"]) == 0
    printed = capsys.readouterr().out
    assert "serve-2-overcommit (fast path): 2 pods of 1 GiB (quota 3 GiB) ready in" in printed
    data = json.loads((out / "serve-bench.json").read_text())
    (run,) = data["runs"]
    (load,) = run["loads"]
    # Model 1000 answers input 3 with another digest (the stand-in's);
    # serve2-01 takes 50 ms an answer.
    assert load["rows"] and all(r["latency_s"] is not None and r["ok"] for r in load["rows"])
    assert [r["identical"] for r in load["rows"]] == [r["pod"] != "serve2-00" or r["input"] != 3
                                                      for r in load["rows"]]
    f = load["figures"]
    assert (f["unanswered"], f["gpu_used_max"], f["resident_mean"], f["host_swapped_max"]) == (0, 500 * MIB, 2, 0)
    table = (out / "serve-bench.md").read_text()
    assert table.splitlines()[2:4] == serve_report.HEAD.splitlines() and "| 2 | fast path | 20 |" in table
    assert f"\n{table}\nraw rows: {out / 'serve-bench.json'}; logs: {out}\n" in printed
    assert tomllib.loads((out / "serve-2-overcommit-hypervisor.toml").read_text())["swap"]["overcommit"] is True
    assert (out / "serve-2-overcommit-hypervisor.log").read_text().rstrip().splitlines()[-1].startswith("# stopped")
    for pod in ("serve2-00", "serve2-01"):  # each answered its exit
        assert (out / f"pod-{pod}.log").read_text().endswith("# exit=0\n")
    assert not [p for p in os.listdir("/dev/shm") if f"swap-bench-{os.getpid()}" in p or "serve2-" in p]


def test_dry_run(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["serve", "--dry-run", "--host-gib", "118", "--out", str(out), "--sizes", "16,4", "--loads", "2,16"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("serve bench, dry run (fast path): GPU 140.4 GiB, host 118 GiB available; [swap] keys"
                              " {'headroom': '\"13g\"', 'min_resident_ms': '250'}")
    # 16 pods first, then 4, then the baseline of 4 (8 and 12 not asked);
    # each load's trace (the seed's), the time each run should take.
    assert printed.splitlines()[1:] == [
        "  16 pods, overcommit: quota 14 GiB each; about 83 s; host_limit 86 GiB, 7 swapped once all are loaded",
        "    2 req/s: 37 requests to 11 of 16 pods (the most asked: 13)",
        "    16 req/s: 184 requests to 16 of 16 pods (the most asked: 60)",
        "  4 pods, overcommit: quota 14 GiB each; about 64 s; host_limit 104 GiB, 0 swapped once all are loaded",
        "    2 req/s: 20 requests to 4 of 4 pods (the most asked: 13)",
        "    16 req/s: 184 requests to 4 of 4 pods (the most asked: 78)",
        "  4 pods, baseline: quota 14 GiB each; about 64 s",
        "    2 req/s: 20 requests to 4 of 4 pods (the most asked: 13)",
        "    16 req/s: 184 requests to 4 of 4 pods (the most asked: 78)",
        f"  about 211 s of 540 s; configs in {out}"]
    assert sorted(p.name for p in out.iterdir()) == ["serve-16-overcommit-hypervisor.toml",
                                                     "serve-4-baseline-hypervisor.toml",
                                                     "serve-4-overcommit-hypervisor.toml"]
    assert tomllib.loads((out / "serve-16-overcommit-hypervisor.toml").read_text())["swap"]["headroom"] == "13g"
