"""The swap bench (python3 -m scripts.bench swap) without a GPU: its options,
the daemon's config, the overcommit plan, nvidia-smi's figures read from a
fake, the pod program's protocol against a small stand-in, a size's rounds
against a stub daemon and pod, the report's rows from known results, and a
run of the entry point whose parts fail or are skipped as they would on a
machine without a GPU."""

import argparse
import json
import os
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
if str(REPO) not in sys.path:  # python3 -m pytest from elsewhere than the repository root
    sys.path.append(str(REPO))

from scripts.bench import swap, swap_bench, swap_parts, swap_report  # noqa: E402
from scripts.bench.__main__ import SUBCOMMANDS, main, parser  # noqa: E402
from scripts.gpu.e2e.harness import hv, parse, proc  # noqa: E402

GIB, MIB = swap_bench.GIB, swap_bench.MIB
HEAD = "| figure | value | target | verdict |\n|---|---|---|---|\n"
LAUNCH_AB = "| no cost for pods never swapped | python3 -m scripts.bench launch-ab |  |  |\n"


def table(*rows):
    return HEAD + "".join(rows) + LAUNCH_AB


@pytest.fixture
def bundle(tmp_path):
    """A bundle folder with the two files the entry point looks for."""
    folder = tmp_path / "bundle"
    folder.mkdir()
    for name in ("libcuda_limiter.so", "hypervisor"):
        (folder / name).write_bytes(b"")
    return folder


def fake_smi(folder, monkeypatch, answers):
    """nvidia-smi first on PATH, printing answers[Q] for its --query-…=Q option
    (nothing for a query not in answers)."""
    path = folder / "path"
    path.mkdir()
    smi = path / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\nimport sys\nanswers = {answers!r}\n"
                   "query = next(a.split('=', 1)[1] for a in sys.argv if a.startswith('--query'))\n"
                   "print(answers.get(query, ''), end='')\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{path}:{os.environ['PATH']}")


def test_entry_point_and_harness():
    """The subcommand's description is swap.py's docstring; the modules use
    the GPU check's harness for medians, nvidia-smi's queries and configs."""
    _, subs = parser()
    assert SUBCOMMANDS["swap"][1] is swap.__doc__ and subs["swap"].description == swap.__doc__
    assert swap.__doc__.startswith("Swapping pods to host memory and back on a real GPU")
    assert swap_parts.med is parse.median and swap_bench.compute_apps is parse.compute_apps
    assert swap_bench.SMI_MEM is proc.SMI_MEM and swap_bench.SMI_APPS is proc.SMI_APPS
    assert swap_bench.POD_PROGRAM == REPO / "scripts" / "bench" / "swap_pod.py" and swap_bench.POD_PROGRAM.is_file()


def test_sizes_parse():
    assert swap.parse_sizes("1,8,32") == [1.0, 8.0, 32.0]
    assert swap.parse_sizes(" 0.5, 2,") == [0.5, 2.0]
    for bad, why in (("1,x", "numbers of GiB separated by commas, not '1,x'"),
                     ("", "at least one size, each above 0, not ''"),
                     (",", "at least one size, each above 0, not ','"),
                     ("4,0", "at least one size, each above 0, not '4,0'"),
                     ("-1", "at least one size, each above 0, not '-1'")):
        with pytest.raises(argparse.ArgumentTypeError) as e:
            swap.parse_sizes(bad)
        assert str(e.value) == why


def test_options_and_their_defaults(bundle, tmp_path, monkeypatch):
    top, subs = parser()
    a = top.parse_args(["swap", "--bundle", str(bundle), "--out", str(tmp_path / "o" / "p"), "--sizes", "2,4",
                        "--rounds", "1", "--infer-rounds", "2", "--idle-s", "0.5", "--parts", " swap, move,",
                        "--budget-s", "60", "--quick"])
    assert (a.sizes, a.rounds, a.infer_rounds, a.idle_s, a.budget_s, a.quick) == ([2.0, 4.0], 1, 2, 0.5, 60.0, True)
    swap.resolve(subs["swap"], a)
    # Given sizes and rounds stand over --quick's; the folder is made.
    assert (a.sizes, a.rounds, a.parts) == ([2.0, 4.0], 1, ["swap", "move"]) and (tmp_path / "o" / "p").is_dir()

    a = top.parse_args(["swap", "--bundle", str(bundle)])
    assert (a.sizes, a.rounds, a.infer_rounds, a.idle_s, a.budget_s, a.quick) == (None, None, 5, 3.0, 450, False)
    assert a.path == "checkpoint"
    assert top.parse_args(["swap", "--bundle", str(bundle), "--path", "fast"]).path == "fast"
    assert top.parse_args(["swap", "--bundle", str(bundle), "--path", "both"]).path == "both"
    with pytest.raises(SystemExit):
        top.parse_args(["swap", "--bundle", str(bundle), "--path", "neither"])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the default folder: a new one here
    swap.resolve(subs["swap"], a)
    assert (a.sizes, a.rounds, a.parts) == ([1.0, 8.0, 32.0], 3, list(swap.DEFAULT_PARTS))
    assert list(swap.DEFAULT_PARTS) == ["bandwidth", "swap", "infer", "overcommit", "move"]
    assert list(swap.PARTS) == [*swap.DEFAULT_PARTS, "limit", "frameworks", "cost"]
    assert Path(a.out).parent == tmp_path and Path(a.out).name.startswith("swap-bench-") and Path(a.out).is_dir()

    a = top.parse_args(["swap", "--bundle", str(bundle), "--quick", "--out", str(tmp_path / "q")])
    swap.resolve(subs["swap"], a)
    assert (a.sizes, a.rounds) == ([1.0, 8.0], 2)

    for argv in (["swap", "--bundle", str(bundle), "--parts", "swap,nothing"],  # an unknown part
                 ["swap", "--bundle", str(tmp_path)],  # no limiter nor daemon there
                 ["swap", "--bundle", str(bundle), "--sizes", "1,0"]):  # a size of 0
        with pytest.raises(SystemExit):
            swap.resolve(subs["swap"], top.parse_args(argv))
    with pytest.raises(SystemExit):
        top.parse_args(["swap"])  # --bundle is required


def test_daemon_config():
    assert swap_bench.swap_section(2000, 42 * GIB) == (
        '[swap]\novercommit = true\nidle_after_ms = 2000\nlatency_pods = "last"\n'
        "host_limit = 45097156608\nroom_wait_ms = 120000\n\n")
    text = swap_bench.config_text({"swap-1g": 5 * GIB, "swap-8g": 12 * GIB}, 1000, 42 * GIB)
    assert tomllib.loads(text) == {
        "listen": "127.0.0.1:0", "admin_token": "admin",
        "swap": {"overcommit": True, "idle_after_ms": 1000, "latency_pods": "last", "host_limit": 42 * GIB,
                 "room_wait_ms": 120000},
        "pods": [{"id": "swap-1g", "token": hv.hv_token("swap-1g"), "gpus": [{"index": 0, "memory": 5 * GIB}]},
                 {"id": "swap-8g", "token": hv.hv_token("swap-8g"), "gpus": [{"index": 0, "memory": 12 * GIB}]}]}


def test_overcommit_plan():
    plan = swap_parts.overcommit_plan
    # An 80 GiB GPU, all but 1 GiB free, host memory to spare: 0.45 of it each.
    assert plan(80 * GIB, 79 * GIB, 200 * GIB) == (40 * GIB, 36 * GIB)
    # Host memory for two of them with their contexts, rounded down to 256 MiB.
    assert plan(80 * GIB, 79 * GIB, 63 * GIB + 400 * MIB) == (40 * GIB, 30 * GIB + 512 * MIB)
    # Two must fit what is free, with a context each (and a third's).
    assert plan(80 * GIB, 50 * GIB, 200 * GIB) == (40 * GIB, 23 * GIB + 512 * MIB)
    # Three that fit at once do not overcommit; none fit at all.
    with pytest.raises(swap_bench.BenchError, match="no overcommit possible: 79 GiB free on the GPU, 40 GiB for"
                                                    " swapped pods on the host: each pod could hold 19 GiB"):
        plan(80 * GIB, 79 * GIB, 40 * GIB)
    with pytest.raises(swap_bench.BenchError, match="each pod could hold 0 GiB"):
        plan(80 * GIB, 3 * GIB, 200 * GIB)


def test_overcommit_given():
    assert swap.parse_overcommit("5x30") == (5, 30.0) and swap.parse_overcommit("2X0.5") == (2, 0.5)
    for bad in ("5", "x30", "1x30", "5x0", "5x30x2"):
        with pytest.raises(argparse.ArgumentTypeError):
            swap.parse_overcommit(bad)
    given = swap_parts.overcommit_given
    context = swap_parts.CONTEXT
    # Five pods of 30 GiB on a 141 GiB GPU, 100 GiB of host memory for swaps.
    assert given(141 * GIB, 140 * GIB, 100 * GIB, 5, 30) == (34 * GIB, 30 * GIB)
    # Fewer that fit at once; one that fits nowhere; two the host cannot hold.
    for args in ((4, 30), (2, 140), (3, 60)):
        with pytest.raises(swap_bench.BenchError, match="they must overcommit the GPU, and two fit the host"):
            given(141 * GIB, 140 * GIB, 100 * GIB, *args)
    assert 4 * (30 * GIB + context) <= 140 * GIB < 5 * (30 * GIB + context)


def test_figures_and_formats():
    assert [swap_bench.gib(n) for n in (35.75 * GIB, 8 * GIB, GIB // 2, 1234 * MIB, 0)] == [
        "35.75", "8", "0.5", "1.21", "0"]
    assert swap_report.share(10.0, 20.0) == 0.5
    assert [swap_report.share(*a) for a in ((None, 20.0), (10.0, None), (10.0, 0))] == [None, None, None]
    assert [swap_report.fmt(1.234), swap_report.fmt(None), swap_report.fmt(5, "d", "?"),
            swap_report.fmt(None, "d", "?"), swap_report.fmt(0.456, ".0%")] == ["1.23", "n/a", "5", "?", "46%"]
    assert (swap_report.yes(1), swap_report.yes(0), swap_report.pass_fail(True), swap_report.pass_fail([])) == (
        "yes", "no", "PASS", "FAIL")


def test_cost_interval():
    from scripts.bench import swap_cost

    mean, half = swap_cost.interval([1.0, 2.0, 3.0])
    # Mean 2, standard deviation 1, t(2) = 4.30: 4.30 / sqrt(3).
    assert mean == 2.0 and abs(half - 4.30 / 3 ** 0.5) < 1e-9
    assert swap_cost.interval([5.0]) == (5.0, None)


def test_freed_on_gpu():
    freed = swap_report.freed_on_gpu
    listed = {"smi_before_mib": 8800, "gpu_used_before_mib": None, "gpu_used_swapped_mib": None}
    # The process listed before: gone, or at 0, while swapped.
    assert freed({**listed, "smi_swapped_mib": None}, 8 * GIB) and freed({**listed, "smi_swapped_mib": 0}, 8 * GIB)
    assert not freed({**listed, "smi_swapped_mib": 12}, 8 * GIB)
    # Not listed (another pid namespace): the GPU's used memory lower by 90% of what it held.
    unlisted = {"smi_before_mib": None, "smi_swapped_mib": None}
    assert freed({**unlisted, "gpu_used_before_mib": 9300, "gpu_used_swapped_mib": 1100}, 8 * GIB)
    assert not freed({**unlisted, "gpu_used_before_mib": 9300, "gpu_used_swapped_mib": 2000}, 8 * GIB)
    assert not freed({**unlisted, "gpu_used_before_mib": None, "gpu_used_swapped_mib": 500}, 8 * GIB)


def test_nvidia_smi_figures(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, {
        "memory.total,memory.used,memory.free": "81559, 1200, 80359\n",
        "pid,used_memory": "123, 4000\n456, [N/A]\n",
        "pid,gpu_uuid,used_memory": "123, GPU-b, 4000\n9, GPU-a, 10\n123, GPU-a, [N/A]\n",
        "index,uuid": "1, GPU-b\n0, GPU-a\nNo devices were found\n"})
    assert swap_bench.gpu_memory() == (81559 * MIB, 1200 * MIB, 80359 * MIB)
    assert swap_bench.smi_mib(123) == (4000, 1200) and swap_bench.smi_mib(456) == (None, 1200)
    assert swap_bench.smi_where(123) == [("GPU-b", 4000)] and swap_bench.smi_where(7) == []
    assert swap_bench.gpu_uuids() == ["GPU-a", "GPU-b"]


def test_nvidia_smi_without_a_gpu(tmp_path, monkeypatch):
    fake_smi(tmp_path, monkeypatch, {"memory.total,memory.used,memory.free": "No devices were found\n"})
    with pytest.raises(swap_bench.BenchError, match="nvidia-smi gave no memory line: 'No devices were found'"):
        swap_bench.gpu_memory()
    assert swap_bench.gpu_uuids() == [] and swap_bench.smi_where(1) == []


STAND_IN = """\
import json, sys
print("REPLY " + json.dumps({"ready": sys.argv[1] == "hold", "error": "no GPU"}), flush=True)
print("warming up", flush=True)
print("REPLY not json", flush=True)
for line in sys.stdin:
    words = line.split()
    if words[0] == "exit":
        break
    if words[0] == "die":
        sys.stderr.write("boom\\n")
        sys.exit(3)
    if words[0] != "quiet":
        print("REPLY " + json.dumps({"echo": words}), flush=True)
"""


def test_pod_protocol(tmp_path, monkeypatch):
    """A pod's REPLY lines are its answers, its other lines chatter kept in
    its log; an exit or silence is a BenchError that says so."""
    program = tmp_path / "stand_in.py"
    program.write_text(STAND_IN)
    monkeypatch.setattr(swap_bench, "POD_PROGRAM", program)
    p = swap_bench.Pod("swap-x", ["hold", "5"], dict(os.environ), tmp_path / "x.log")
    assert p.ready(10) == {"ready": True, "error": "no GPU"}
    answer, took = p.ask("alloc 5", 10)
    assert answer == {"echo": ["alloc", "5"]} and 0 <= took < 10
    with pytest.raises(swap_bench.BenchError, match="swap-x: no answer within 0.2 s"):
        p.ask("quiet", 0.2)
    p.stop()
    assert p.p.returncode == 0
    assert (tmp_path / "x.log").read_text() == "# swap-x: hold 5\nwarming up\nREPLY not json\n# exit=0\n"

    p = swap_bench.Pod("swap-y", ["work"], dict(os.environ), tmp_path / "y.log")
    with pytest.raises(swap_bench.BenchError, match="swap-y not ready: no GPU"):
        p.ready(10)
    with pytest.raises(swap_bench.BenchError, match=r"swap-y exited \(status 3\): # swap-y: work boom"):
        p.ask("die", 10)
    p.stop()

    p = swap_bench.Pod("swap-z", ["hold", "1"], dict(os.environ), tmp_path / "z.log")
    p.ready(10)
    p.stop(graceful=False)  # SIGTERM to its group
    assert p.p.returncode == -15 and (tmp_path / "z.log").read_text().endswith("# exit=-15\n")


def test_bench_time_and_host_room(tmp_path, monkeypatch):
    args = SimpleNamespace(bundle=str(tmp_path), out=str(tmp_path), budget_s=450)
    for available, limit in ((50 * GIB, 42 * GIB), (500 * GIB, 100 * GIB), (4 * GIB, GIB)):
        monkeypatch.setattr(swap_bench, "host_available", lambda: available)
        assert swap_bench.Bench(args).host_limit == limit
    b = swap_bench.Bench(args)
    assert b.lib == str(tmp_path / "libcuda_limiter.so")
    assert b.tables == {"GPUSHARE_NODE_REGION": f"gpushare-node-swap-bench-{os.getpid()}",
                        "GPUSHARE_PRIORITY_REGION": f"gpushare-priority-swap-bench-{os.getpid()}"}
    # A minute and 4 s a GiB (8 s with per_gib=8), at least 10 s, within the run's time left.
    assert b.timeout(8 * GIB) == 92.0 and b.timeout(8 * GIB, per_gib=8.0) == 124.0 and b.timeout(0) == 60.0
    b.begin("swap")
    b.deadline = time.monotonic() + 40
    assert b.timeout(8 * GIB) == pytest.approx(40, abs=1)
    b.begin("swap")
    b.deadline = time.monotonic() + 20
    assert b.timeout(8 * GIB) == pytest.approx(20, abs=1)
    with pytest.raises(swap_bench.BenchError, match=r"move not run: the run's time \(--budget-s\) is spent"):
        b.begin("move")
    b.deadline = time.monotonic() - 5
    assert b.timeout(8 * GIB) == 10.0
    # A daemon whose swap hung is not asked again.
    b.stuck = "swap-out of swap-8g not answered within 92 s"
    assert (b.status(), b.pod_swap("swap-8g"), b.totals(), b.metrics()) == ({}, {}, {}, [])


def test_guarded(capsys):
    assert swap_bench.guarded("part", lambda x: {"x": x}, 3) == {"x": 3}
    assert swap_bench.guarded("part", lambda: 1 / 0) == {"failed": "ZeroDivisionError: division by zero"}
    captured = capsys.readouterr()
    assert captured.out == "part: FAILED: ZeroDivisionError: division by zero\n" and "Traceback" in captured.err


DIGESTS = {"data": "d1", "matmul": "m1", "matmul_sum": 1.5}


class StubPod:
    """A swap_pod.py in `hold` mode holding `held` of `quota`: digests that
    stay, and allocations refused past the quota."""

    def __init__(self, held, quota):
        self.p = SimpleNamespace(pid=4242)
        self.room = self.free = quota - held - GIB

    def ready(self):
        return {"ready": True, "fill_s": 2.0, **DIGESTS}

    def ask(self, command, timeout):
        word, *n = command.split()
        if word == "check":
            return dict(DIGESTS), 0.1
        if word == "alloc":
            fits = int(n[0]) <= self.free
            self.free -= int(n[0]) if fits else 0
            return {"alloc": "ok" if fits else "oom"}, 0.1
        self.free = self.room  # release
        return {}, 0.1


class StubBench:
    """The daemon's side of a size's rounds: the swaps' seconds as given,
    the swap-ins answered with `in_http`."""

    def __init__(self, rounds, outs, ins, in_http=200):
        self.args, self.stuck, self.stopped = SimpleNamespace(rounds=rounds, path="checkpoint"), None, []
        self.outs, self.ins, self.in_http = iter(outs), iter(ins), in_http

    def start_pod(self, pod, mode, held):
        self.pod = StubPod(held, held + swap_parts.QUOTA_MARGIN)
        return self.pod

    def stop_pod(self, p):
        self.stopped.append(p)

    def swapped(self, pod, nbytes):
        return {"http": 200, "seconds": next(self.outs), "residency": "swapped"}

    def swap(self, pod, action, nbytes):
        if self.in_http != 200:
            return {"http": self.in_http, "seconds": 0.1, "error": "busy"}
        return {"http": 200, "seconds": next(self.ins), "residency": "resident"}

    def pod_swap(self, pod):
        return {"state": "resident", "bytes_on_host": 9 * GIB, "last_swap_out_s": 3.5, "last_swap_in_s": 1.25,
                "last_swap_out_path": "checkpoint"}

    def totals(self):
        return {}


@pytest.fixture
def smi_swapped(monkeypatch):
    """nvidia-smi's (process MiB, GPU used MiB): before, while swapped, after, round after round."""
    figures = iter([(8800, 9300), (None, 500), (8800, 9300)] * 3)
    monkeypatch.setattr(swap_parts, "smi_mib", lambda pid: next(figures))


def test_swap_size_rounds(smi_swapped, capsys):
    b = StubBench(3, outs=[4.0, 3.0, 6.0], ins=[2.0, 1.0, 1.5])
    one = swap_parts.swap_size(b, 8.0, {"d2h_median": 25.0, "h2d_median": 18.0})
    assert b.stopped == [b.pod] and (one["held"], one["quota"]) == (8 * GIB, 12 * GIB)
    # The rates count the 9 GiB the daemon moved, not the 8 the pod holds.
    assert [(r["out_gibs"], r["in_gibs"]) for r in one["rounds"]] == [(2.25, 4.5), (3.0, 9.0), (1.5, 6.0)]
    assert one["rounds"][0]["alloc"] == ["ok", "oom"] and one["rounds"][0]["daemon_out_s"] == 3.5
    assert one["summary"] == {
        "moved": 9 * GIB, "out_s": 4.0, "in_s": 1.5, "out_gibs": 2.25, "in_gibs": 6.0, "daemon_out_s": 3.5,
        "daemon_in_s": 1.25, "smi_before_mib": 8800, "smi_swapped_mib": None, "smi_after_mib": 8800,
        "gpu_used_before_mib": 9300, "gpu_used_swapped_mib": 500, "gpu_used_after_mib": 9300, "identical": True,
        "quota_intact": True, "out_share": 0.09, "in_share": 6 / 18, "first_out_s": 4.0, "prepared_s": None}
    printed = capsys.readouterr().out
    assert "  median of 3: out 4.00 s (2.25 GiB/s), in 1.50 s (6.00 GiB/s)\n" in printed
    assert ("  round 1: 9 GiB moved by the checkpoint path; out 4.00 s (2.25 GiB/s, 9% of pinned D2H; daemon 3.50 s), in 2.00 s"
            " (4.50 GiB/s, 25% of pinned H2D; daemon 1.25 s); nvidia-smi MiB 8800 / absent / 8800 (GPU used"
            " 9300 / 500 / 9300); identical yes; quota intact yes ['ok', 'oom']\n") in printed
    # Its report: the swap-in of 8 GiB within 2 s, the bandwidths below half of pinned.
    assert swap_report.swap_rows(8.0, one) == [
        ("swap-out 8 GiB, s (GiB/s, of pinned D2H)", "4.00 (2.25, 9%)", "stretch >= 50% of pinned", "stretch FAIL"),
        ("swap-in 8 GiB, s (GiB/s, of pinned H2D)", "1.50 (6.00, 33%)", "<= 2 s; stretch >= 50% of pinned",
         "PASS; stretch FAIL"),
        ("8 GiB: nvidia-smi MiB of the process before / swapped / after (GPU used)",
         "8800 / absent / 8800 (9300 / 500 / 9300)", "none while swapped", "PASS"),
        ("8 GiB after swap: identical, quota intact", "yes, yes", "yes, yes", "PASS")]


def test_swap_size_whose_swap_ins_fail(smi_swapped):
    b = StubBench(3, outs=[4.0, 3.0, 6.0], ins=[], in_http=500)
    one = swap_parts.swap_size(b, 8.0, {})
    assert b.stopped == [b.pod] and len(one["rounds"]) == 3 and "summary" not in one
    assert one["failed"] == "swap-out 4.00, 3.00, 6.00 s; BenchError: swap-in of swap-8g: HTTP 500 busy"
    assert swap_report.swap_rows(8.0, one) == [("swap 8 GiB", "FAILED", "", one["failed"])]


def summary(**over):
    figures = {"out_s": 4.0, "in_s": 1.6, "out_gibs": 2.25, "in_gibs": 15.0, "out_share": 0.09, "in_share": 0.6,
               "smi_before_mib": 8800.0, "smi_swapped_mib": None, "smi_after_mib": 8800.0,
               "gpu_used_before_mib": 9300.0, "gpu_used_swapped_mib": 500.0, "gpu_used_after_mib": 9300.0,
               "identical": True, "quota_intact": True}
    return {**figures, **over}


def test_report_of_every_part():
    results = {
        "bandwidth": {"h2d_median": 24.56, "d2h_median": 25.0},
        "swap": {"1": {"failed": "not run: host room for swapped pods 0.5 GiB"},
                 "8": {"held": 8 * GIB, "summary": summary()},
                 "32": {"held": 32 * GIB, "summary": summary(in_s=20.0, in_share=None, smi_swapped_mib=100.0,
                                                             quota_intact=False)}},
        "infer": {"t0_s": 0.01234, "t1_s": 1.5, "t1_pod_s": 1.25, "identical": True, "resident": [{}, {}, {}],
                  "swapped_ok": 3},
        "overcommit": {"quota": 40 * GIB, "hold": 36 * GIB, "turns": [{}] * 6,
                       "totals": {"swap_outs": 5, "swap_ins": 4}, "pass": True, "why": []},
        "move": {"line": "PASS: move 1 2.10 s; move 0 2.00 s; drain 0 2.20 s; on the other GPU, identical,"
                         " quota intact"},
        "frameworks": {"workloads": {
            "jax": {"path_out": "fast", "path_in": "fast", "smi_swapped_mib": 600, "identical": True},
            "torch-expandable": {"path_out": "checkpoint", "path_in": "checkpoint", "smi_swapped_mib": None,
                                 "identical": True, "fast_declined": "its processes still hold 2 GiB"},
            "cupy": {"path_out": None, "identical": False},
            "triton": {"failed": "RuntimeError: no triton"}}},
        "cost": {"alloc_us": {"off": 10.0, "on": 40.5, "diff": 30.25, "ci": 1.5},
                 "step_ms": {"off": 5.0, "on": 5.01, "diff": 0.01, "ci": None}},
    }
    assert swap_report.report(results, [1.0, 8.0, 32.0]) == table(
        "| pinned H2D / D2H, GiB/s | 24.6 / 25.0 | the physical limit |  |\n",
        "| swap 1 GiB | FAILED |  | not run: host room for swapped pods 0.5 GiB |\n",
        "| swap-out 8 GiB, s (GiB/s, of pinned D2H) | 4.00 (2.25, 9%) | stretch >= 50% of pinned | stretch FAIL |\n",
        "| swap-in 8 GiB, s (GiB/s, of pinned H2D) | 1.60 (15.00, 60%) | <= 2 s; stretch >= 50% of pinned"
        " | PASS; stretch PASS |\n",
        "| 8 GiB: nvidia-smi MiB of the process before / swapped / after (GPU used) | 8800 / absent / 8800"
        " (9300 / 500 / 9300) | none while swapped | PASS |\n",
        "| 8 GiB after swap: identical, quota intact | yes, yes | yes, yes | PASS |\n",
        "| swap-out 32 GiB, s (GiB/s, of pinned D2H) | 4.00 (2.25, 9%) | stretch >= 50% of pinned"
        " | stretch FAIL |\n",
        "| swap-in 32 GiB, s (GiB/s, of pinned H2D) | 20.00 (15.00, n/a) | stretch >= 50% of pinned"
        " | stretch n/a |\n",
        "| 32 GiB: nvidia-smi MiB of the process before / swapped / after (GPU used) | 8800 / 100 / 8800"
        " (9300 / 500 / 9300) | none while swapped | FAIL |\n",
        "| 32 GiB after swap: identical, quota intact | yes, no | yes, yes | FAIL |\n",
        "| first request after idle, resident (T0), s | 0.0123 |  |  |\n",
        "| first request after idle, swapped (T1), s (pod's own) | 1.50 (1.25) | <= 3 s | PASS |\n",
        "| inference outputs identical (requests resident, swapped) | yes (3, 3) | yes | PASS |\n",
        "| overcommit, 3 pods of quota 40 GiB holding 36 GiB | 6 requests, 5 swaps out, 4 in"
        " | no OOM, digests identical | PASS |\n",
        "| jax: paths out / in, nvidia-smi MiB swapped, identical | fast / fast, 600, yes | identical | PASS |\n",
        "| torch-expandable: paths out / in, nvidia-smi MiB swapped, identical | checkpoint / checkpoint, absent,"
        " yes; fast declined: its processes still hold 2 GiB | identical | PASS |\n",
        "| cupy: paths out / in, nvidia-smi MiB swapped, identical | not swapped / -, absent, no | identical"
        " | FAIL |\n",
        "| triton: swapped out and back | FAILED |  | RuntimeError: no triton |\n",
        "| never swapped, setting off / on: cuMemAlloc_v2 + cuMemFree_v2 of 8 MiB, µs | 10.000 / 40.500"
        " (on - off +30.250 ± 1.500, 95% CI) |  |  |\n",
        "| never swapped, setting off / on: PyTorch training step, ms | 5.000 / 5.010 (on - off +0.010 ± n/a,"
        " 95% CI) |  |  |\n",
        "| move between GPUs | PASS: move 1 2.10 s; move 0 2.00 s; drain 0 2.20 s; on the other GPU, identical,"
        " quota intact |  |  |\n")


def test_report_of_failures():
    long = "BenchError: exit 1: " + "x" * 200
    results = {
        "bandwidth": {"failed": long},
        "swap": {"8": {"held": 8 * GIB, "summary": summary(in_s=2.5, in_share=0.2)}},
        "infer": {"t0_s": 0.5, "t1_s": None, "t1_pod_s": None, "identical": True, "resident": [{}, {}],
                  "swapped_ok": 0, "failed": "no swapped request: BenchError: swap-infer: no answer within 60 s"},
        "overcommit": {"failed": "BenchError: no overcommit possible"},
    }
    # A size asked for but missing from the results was not run; a part
    # missing altogether has no rows but move's.
    assert swap_report.report(results, [8.0, 32.0]) == table(
        f"| pinned H2D / D2H, GiB/s | FAILED | the physical limit | {long[:120]} |\n",
        "| swap-out 8 GiB, s (GiB/s, of pinned D2H) | 4.00 (2.25, 9%) | stretch >= 50% of pinned | stretch FAIL |\n",
        "| swap-in 8 GiB, s (GiB/s, of pinned H2D) | 2.50 (15.00, 20%) | <= 2 s; stretch >= 50% of pinned"
        " | FAIL; stretch FAIL |\n",
        "| 8 GiB: nvidia-smi MiB of the process before / swapped / after (GPU used) | 8800 / absent / 8800"
        " (9300 / 500 / 9300) | none while swapped | PASS |\n",
        "| 8 GiB after swap: identical, quota intact | yes, yes | yes, yes | PASS |\n",
        "| swap 32 GiB | FAILED |  | not run |\n",
        "| first request after idle, resident (T0), s | 0.5000 |  |  |\n",
        "| first request after idle, swapped (T1) | FAILED |  | no swapped request: BenchError: swap-infer: no"
        " answer within 60 s |\n",
        "| inference outputs identical (requests resident, swapped) | yes (2, 0) | yes | FAIL |\n",
        "| overcommit, 3 pods of 0.5xM | FAILED |  | BenchError: no overcommit possible |\n",
        "| move between GPUs | not run |  |  |\n")
    assert swap_report.report({"swap": {"failed": "BenchError: the daemon did not start"},
                               "overcommit": {"quota": 40 * GIB, "hold": 36 * GIB, "turns": [{}] * 4,
                                              "totals": {}, "pass": False,
                                              "why": ["out of memory", "a request failed"]}}, [1.0]) == table(
        "| swap | FAILED |  | BenchError: the daemon did not start |\n",
        "| overcommit, 3 pods of quota 40 GiB holding 36 GiB | 4 requests, None swaps out, None in"
        " | no OOM, digests identical | FAIL out of memory, a request failed |\n",
        "| move between GPUs | not run |  |  |\n")
    # Timed requests: the slowest against the bar.
    timed = [{"bench_s": 0.5}, {"bench_s": 4.12}, {"bench_s": None}]
    assert swap_report.report({"overcommit": {"pods": 5, "quota": 34 * GIB, "hold": 30 * GIB, "turns": timed,
                                              "totals": {"swap_outs": 3, "swap_ins": 2}, "pass": True,
                                              "why": []}}, [1.0]) == table(
        "| overcommit, 5 pods of quota 34 GiB holding 30 GiB | 3 requests, 3 swaps out, 2 in"
        " | no OOM, digests identical | PASS |\n",
        "| overcommit, slowest request (a swap-out and a swap-in at most), s | 4.12 | <= 3 s | FAIL |\n",
        "| move between GPUs | not run |  |  |\n")


def both_paths():
    """The swap part of both paths, two sizes each: the checkpoint's 8 GiB
    too slow; the fast path's 1 GiB leaving 1,000 of its 8,800 MiB on the
    GPU while swapped, its 8 GiB (the process not listed: the GPU's used
    memory tells) too slow, 94.6% given back, its quota broken."""
    return {
        "checkpoint": {"1": {"held": GIB, "summary": summary(out_s=0.5, in_s=0.4, out_gibs=2.0, in_gibs=2.5,
                                                             out_share=0.08, in_share=0.1)},
                       "8": {"held": 8 * GIB, "summary": summary(in_s=2.5, in_gibs=3.6, in_share=0.15)},
                       "totals": {"swap_outs": 4}, "metrics": []},
        "fast": {"1": {"held": GIB, "summary": summary(out_s=0.1, in_s=0.08, out_gibs=10.0, in_gibs=12.5,
                                                       out_share=0.4, in_share=0.51, smi_swapped_mib=1000.0)},
                 "8": {"held": 8 * GIB, "summary": summary(out_s=0.6, in_s=0.5, out_gibs=15.0, in_gibs=18.0,
                                                           out_share=0.6, in_share=0.73, smi_before_mib=None,
                                                           smi_after_mib=None, quota_intact=False)},
                 "totals": {"swap_outs": 4}, "metrics": []}}


SIDE_HEAD = ("| size, GiB | checkpoint: out, s (GiB/s, of pinned D2H) | checkpoint: in, s (GiB/s, of pinned H2D)"
             " | checkpoint: given back (nvidia-smi MiB before / swapped) | checkpoint: identical, quota intact"
             " | checkpoint: verdict | fast: out, s (GiB/s, of pinned D2H) | fast: in, s (GiB/s, of pinned H2D)"
             " | fast: given back (nvidia-smi MiB before / swapped) | fast: identical, quota intact | fast: verdict |")
TARGETS = ("Targets: 8 GiB out and in <= 0.4 s each; >= 95% of the pod's device memory given back while swapped;"
           " results identical and the quota intact; stretch: >= 50% of the pinned link (as measured in this run,"
           " above) each way.\n")


def side_by_side(text):
    """A report of both paths: (its main table, its side-by-side table as
    {size: {column: cell}}, the lines after)."""
    main_table, side, after = text.split("\n\n")
    lines = side.splitlines()
    assert lines[0] == SIDE_HEAD and lines[1] == "|" + "---|" * 11

    def cells(line):
        return [c.strip() for c in line.strip("|").split("|")]
    head = cells(lines[0])
    return main_table + "\n", {row[0]: dict(zip(head, row)) for row in map(cells, lines[2:])}, after


def test_report_of_both_paths():
    """Both paths: the main table's swap row points below, where each size
    has a row with each path's figures in that path's columns and its
    verdict: FAIL and the targets missed, then the stretch's."""
    results = {"bandwidth": {"h2d_median": 24.56, "d2h_median": 25.0}, "swap": both_paths()}
    main_table, rows, after = side_by_side(swap_report.report(results, [1.0, 8.0]))
    assert main_table == table("| pinned H2D / D2H, GiB/s | 24.6 / 25.0 | the physical limit |  |\n",
                               "| swap, checkpoint and fast paths | side by side below |  |  |\n",
                               "| move between GPUs | not run |  |  |\n")
    assert rows == {
        "1": {"size, GiB": "1",
              "checkpoint: out, s (GiB/s, of pinned D2H)": "0.50 (2.00, 8%)",
              "checkpoint: in, s (GiB/s, of pinned H2D)": "0.40 (2.50, 10%)",
              "checkpoint: given back (nvidia-smi MiB before / swapped)": "100.0% (8800 / absent)",
              "checkpoint: identical, quota intact": "yes, yes",
              "checkpoint: verdict": "PASS; stretch FAIL",
              "fast: out, s (GiB/s, of pinned D2H)": "0.10 (10.00, 40%)",
              "fast: in, s (GiB/s, of pinned H2D)": "0.08 (12.50, 51%)",
              "fast: given back (nvidia-smi MiB before / swapped)": "88.6% (8800 / 1000)",
              "fast: identical, quota intact": "yes, yes",
              "fast: verdict": "FAIL under 95% given back; stretch out FAIL, in PASS"},
        "8": {"size, GiB": "8",
              "checkpoint: out, s (GiB/s, of pinned D2H)": "4.00 (2.25, 9%)",
              "checkpoint: in, s (GiB/s, of pinned H2D)": "2.50 (3.60, 15%)",
              "checkpoint: given back (nvidia-smi MiB before / swapped)": "100.0% (8800 / absent)",
              "checkpoint: identical, quota intact": "yes, yes",
              "checkpoint: verdict": "FAIL 8 GiB out (median or first) or in > 0.4 s; stretch FAIL",
              "fast: out, s (GiB/s, of pinned D2H)": "0.60 (15.00, 60%)",
              "fast: in, s (GiB/s, of pinned H2D)": "0.50 (18.00, 73%)",
              "fast: given back (nvidia-smi MiB before / swapped)": "94.6% (GPU used 9300 / 500)",
              "fast: identical, quota intact": "yes, no",
              "fast: verdict": "FAIL 8 GiB out (median or first) or in > 0.4 s, under 95% given back, quota not intact; stretch PASS"}}
    assert after == TARGETS
    # A path whose part failed fails each size; a size missing was not run.
    results["swap"]["checkpoint"] = {"failed": "BenchError: the daemon did not start"}
    _, rows, _ = side_by_side(swap_report.report(results, [1.0, 32.0]))
    assert [rows["1"][f"checkpoint: {c}"] for c in swap_report.SIDE_COLUMNS] == [
        "FAILED", "", "", "", "FAIL BenchError: the daemon did not start"]
    assert rows["1"]["fast: in, s (GiB/s, of pinned H2D)"] == "0.08 (12.50, 51%)"
    assert [rows["32"][f"{path}: {c}"] for path in ("checkpoint", "fast") for c in ("out, s (GiB/s, of pinned D2H)",
                                                                                   "verdict")] == [
        "FAILED", "FAIL BenchError: the daemon did not start", "FAILED", "FAIL not run"]


def test_run_of_both_paths(bundle, tmp_path, monkeypatch, capsys):
    """--path both: the bandwidth part once; the swap part on the checkpoint
    path, then on the fast path, each part's pods started with its path's
    environment and their logs in OUT/PATH; the other parts on the fast
    path; the report and the raw numbers of both."""
    pinned, started = {"h2d_median": 24.56, "d2h_median": 25.0}, []

    class FakePod:
        def __init__(self, pod, argv, env, log, program=None, route=None):
            self.pod, self.env, self.log = pod, env, log

    def start(b, part):
        """A pod started as the part would start it: its path, its log's folder, its setting."""
        b.daemon = SimpleNamespace(url="http://127.0.0.1:1")
        p = b.start_pod(f"swap-{part}", "hold", GIB)
        b.daemon = None
        b.pods.remove(p)
        started.append((part, b.args.path, p.log.parent, p.env.get("CUDA_LIMITER_FAST_SWAP")))

    def part_swap(b, given):
        assert given is bandwidth[0]  # the pinned figures of the run's one bandwidth part
        start(b, "swap")
        return both_paths()[b.args.path]

    def part_infer(b):
        start(b, "infer")
        return {"t0_s": 0.01, "t1_s": 1.5, "t1_pod_s": 1.25, "identical": True, "resident": [{}], "swapped_ok": 1}

    bandwidth = []
    monkeypatch.setattr(swap_bench, "Pod", FakePod)
    monkeypatch.setattr(swap, "part_bandwidth", lambda b: bandwidth.append(dict(pinned)) or bandwidth[-1])
    monkeypatch.setattr(swap, "part_swap", part_swap)
    monkeypatch.setattr(swap, "part_infer", part_infer)
    out = tmp_path / "out"
    assert main(["swap", "--bundle", str(bundle), "--out", str(out), "--sizes", "1,8", "--path", "both",
                 "--parts", "bandwidth,swap,infer"]) == 0
    assert len(bandwidth) == 1 and started == [("swap", "checkpoint", out / "checkpoint", None),
                                               ("swap", "fast", out / "fast", "1"), ("infer", "fast", out, "1")]
    printed = capsys.readouterr().out
    line = "checkpoint and fast paths: the swap part on each, the other parts on the fast path"
    assert printed.startswith(f"swap bench ({line}): sizes ['1', '8'] GiB, 3 rounds;")
    assert printed.index("swap part, checkpoint path:\n") < printed.index("swap part, fast path:\n")
    text = (out / "swap-bench.md").read_text()
    assert text.startswith(f"Swap bench, {line} (") and f"\n{text}\n" in printed
    main_table, rows, after = side_by_side(text.split("\n\n", 1)[1])
    assert "| swap, checkpoint and fast paths | side by side below |  |  |\n" in main_table
    assert "| first request after idle, swapped (T1), s (pod's own) | 1.50 (1.25) | <= 3 s | PASS |\n" in main_table
    assert rows["8"]["checkpoint: verdict"] == "FAIL 8 GiB out (median or first) or in > 0.4 s; stretch FAIL" and after == TARGETS
    data = json.loads((out / "swap-bench.json").read_text())
    assert data["args"]["path"] == "both" and data["bandwidth"] == pinned and data["swap"] == both_paths()


def test_run_without_a_gpu(bundle, tmp_path, monkeypatch, capsys):
    """The entry point's run: a part that fails is a FAILED row and the run
    goes on; one GPU: no move; the table and the raw numbers written."""
    fake_smi(tmp_path, monkeypatch, {"index,uuid": "0, GPU-a\n"})
    out = tmp_path / "out"
    assert main(["swap", "--bundle", str(bundle), "--out", str(out), "--quick", "--parts", "overcommit,move"]) == 0
    printed = capsys.readouterr().out
    why = "BenchError: nvidia-smi gave no memory line: ''"
    assert printed.startswith("swap bench (checkpoint path): sizes ['1', '8'] GiB, 2 rounds; host memory for swapped pods ")
    assert f"\novercommit: FAILED: {why}\nmove: not run (one GPU)\n" in printed
    text = (out / "swap-bench.md").read_text()
    assert text.startswith("Swap bench, checkpoint path (") and text.split("\n\n", 1)[1] == table(
        f"| overcommit, 3 pods of 0.5xM | FAILED |  | {why} |\n",
        "| move between GPUs | not run (one GPU) |  |  |\n")
    assert f"\n{text}\nraw numbers: {out / 'swap-bench.json'}; logs: {out}\n" in printed
    data = json.loads((out / "swap-bench.json").read_text())
    assert data["overcommit"] == {"failed": why} and data["move"] == {"line": "not run (one GPU)"}
    assert data["args"]["sizes"] == [1.0, 8.0] and data["args"]["parts"] == ["overcommit", "move"]
    assert sorted(p.name for p in out.iterdir()) == ["swap-bench.json", "swap-bench.md"]
    assert not [p for p in os.listdir("/dev/shm") if f"swap-bench-{os.getpid()}" in p]


class PreparingBench(StubBench):
    """A fast-path run whose daemon has the pod's copies prepared at the
    third look."""

    def __init__(self):
        super().__init__(1, outs=[0.17], ins=[0.16])
        self.args.path, self.looks = "fast", 0

    def pod_swap(self, pod):
        return {"state": "resident", "bytes_on_host": 8 * GIB, "last_swap_out_path": "fast",
                "host_kept_bytes": 8 * GIB if self.looks >= 3 else 0}

    def totals(self):
        # One prepare counted from an earlier pod: this pod's is the second.
        self.looks += 1
        return {"host_prepares": 2 if self.looks >= 3 else 1}


def test_the_one_path_report_of_the_fast_path_takes_its_targets():
    s = {"out_s": 0.17, "in_s": 0.5, "out_gibs": 48.0, "in_gibs": 16.0, "out_share": 0.94, "in_share": 0.3,
         "smi_before_mib": 8998, "smi_swapped_mib": 350, "smi_after_mib": 8998, "gpu_used_before_mib": 9023,
         "gpu_used_swapped_mib": 375, "gpu_used_after_mib": 9023, "identical": True, "quota_intact": True}
    one = {"held": 8 * GIB, "summary": s, "rounds": [{"path": "fast"}]}
    rows = {row[0].split(",")[0]: row for row in swap_report.swap_rows(8.0, one)}
    assert rows["swap-in 8 GiB"][2:] == ("<= 0.4 s; stretch >= 50% of pinned", "FAIL; stretch FAIL")
    assert rows["8 GiB: nvidia-smi MiB of the process before / swapped / after (GPU used)"][2:] == (
        ">= 95% given back", "PASS")
    one["rounds"] = [{"path": "checkpoint"}]
    rows = {row[0].split(",")[0]: row for row in swap_report.swap_rows(8.0, one)}
    assert rows["swap-in 8 GiB"][2:] == ("<= 2 s; stretch >= 50% of pinned", "PASS; stretch FAIL")
    assert rows["8 GiB: nvidia-smi MiB of the process before / swapped / after (GPU used)"][2:] == (
        "none while swapped", "FAIL")


def test_a_fast_pod_waits_for_its_copies_and_its_first_swap_out_counts(smi_swapped, monkeypatch, capsys):
    monkeypatch.setattr(swap_parts.time, "sleep", lambda s: None)
    one = swap_parts.swap_size(PreparingBench(), 8.0, {"d2h_median": 50.0, "h2d_median": 50.0})
    assert one["summary"]["first_out_s"] == 0.17 and one["summary"]["prepared_s"] is not None
    assert "host copies prepared ahead while idle" in capsys.readouterr().out
    verdict = swap_report.path_verdict
    summary = dict(one["summary"], smi_swapped_mib=300)
    assert verdict(8.0, summary, 0.96).startswith("PASS")
    # A first swap-out that pinned as it copied misses the target, whatever the median.
    assert verdict(8.0, dict(summary, first_out_s=0.84), 0.96).startswith("FAIL 8 GiB out (median or first)")
