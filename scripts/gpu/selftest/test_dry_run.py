"""The whole harness, run here against fakegpu.py (no GPU, no nvcc): every
check runs, every row of the bash script's table is produced, nothing in the
harness crashes, and a program that crashes becomes a FAIL row while the run
goes on. With the daemon built (builds.py), checks 16-19 drive the real
daemon (--simulate-gpus 1) on a port the harness picks."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from builds import built, double_dir

HERE = Path(__file__).resolve().parent
GPU = HERE.parent
PROGRAMS = ["mem_runtime", "mem_runtime_shared", "mem_apis", "mem_hold", "mem_pairs", "mem_bench", "spin",
            "launch_overhead", "implicit_mem", "ipc_share"]
# the table of scripts/gpu-e2e.sh had 60 rows; oversubscription added 4, the context race 1, implicit 9,
# frameworks 2, the lazy global and green contexts 2, IPC and VMM imports 2, a custom pool 1, the examples 2
ROWS = 83
# How many runs of the harness test_every_check_runs makes at once.
SHARDS = 4


@pytest.fixture(scope="module")
def fake_env():
    # A directory of its own, removed afterwards: the harness's work, the
    # fake programs and the fake pods' state leave nothing in /tmp.
    with tempfile.TemporaryDirectory(prefix="gpu-selftest-") as directory:
        yield make_fake_env(Path(directory))


def make_fake_env(root):
    bins, path, bundle = root / "bin", root / "path", root / "bundle"
    for d in (bins, path, bundle):
        d.mkdir()
    fake = HERE / "fakegpu.py"
    for name in PROGRAMS:
        (bins / name).symlink_to(fake)
    (bins / "big_global.cubin").write_bytes(b"")  # implicit_mem's module; the fake does not read it
    (path / "nvidia-smi").symlink_to(fake)
    (path / "python").symlink_to(fake)
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc:
        subprocess.run([cc, "-O2", "-o", str(bins / "spawn_bench"), str(GPU / "spawn_bench.c")], check=True)
    lib = built("libcuda_limiter.so")
    if lib:
        shutil.copy(lib, bundle / "libcuda_limiter.so")
    else:
        (bundle / "libcuda_limiter.so").write_bytes(b"")
    hv = built("hypervisor")
    if hv:
        shutil.copy(hv, bundle / "hypervisor")
    return root, bins, path, bundle


def start_harness(fake_env, name, *args, **env):
    """Starts one run of the harness (its own output, work folder and fake
    GPU state); finish_harness waits for it."""
    root, bins, path, bundle = fake_env
    out = root / name
    state = root / f"{name}-state"
    state.mkdir()
    e = {k: v for k, v in os.environ.items() if not k.startswith(("E2E_", "CUDA_"))}
    # Check 43a's run.sh runs quota.c on the driver double, or finds no
    # driver in an empty folder (it would build the double otherwise).
    double = double_dir() or root
    e.update(PATH=f"{path}:{e['PATH']}", PYTHON=str(path / "python"), E2E_SHARE_SECS="2", E2E_TORCH_SECS="1",
             E2E_HV_SIMULATE="1", FAKEGPU_STATE_DIR=str(state), OUT=str(out), GPUSHARE_DOUBLE_DIR=str(double),
             **env)
    harness = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", str(GPU / "e2e"),
                                "--rootdir", str(GPU / "e2e"), "--bundle", str(bundle), "--bin-dir", str(bins),
                                "--work", str(root / f"{name}-work"), *args], env=e, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    return harness, out


def finish_harness(started):
    harness, out = started
    try:
        stdout, stderr = harness.communicate(timeout=900)
    finally:
        harness.kill()
    r = subprocess.CompletedProcess(harness.args, harness.returncode, stdout, stderr)
    data = json.loads((out / "results.json").read_text())
    return r, data, out


def run_harness(fake_env, name, *args, **env):
    return finish_harness(start_harness(fake_env, name, *args, **env))


def test_every_check_runs(fake_env):
    # The checks, dealt by number into runs of the harness at once: on the
    # fakes they mostly wait on their programs, one after another. Each run
    # is the harness as a GPU machine runs it, on a part of the table.
    started = [start_harness(fake_env, f"all-{k}", "--checks", " ".join(str(n) for n in range(44) if n % SHARDS == k))
               for k in range(SHARDS)]
    runs = [finish_harness(s) for s in started]
    rows = [x for _, data, _ in runs for x in data["rows"]]
    names = [x["check"] for x in rows]
    crashed = [x for x in rows if any(w.startswith("crashed") for w in x["reasons"])]
    assert not crashed, crashed
    # Every row once, and the preflight's row (no limiter built) once a run.
    assert len(rows) == ROWS + SHARDS * ("0. limiter library present" in names), names
    assert len(set(names) - {"0. limiter library present"}) == ROWS, names
    for prefix in [f"{n}." for n in range(1, 43) if n not in (17, 22)] + ["17a.", "17b.", "22a.", "22b.", "43a.",
                                                                          "43b."]:
        assert any(n.startswith(prefix) for n in names), prefix
    by = {x["check"]: x for x in rows}
    # the fakes report what a working limiter gives: these rows pass
    bad = [by[n] for n in names if by[n]["result"] != "PASS" and n.startswith(
        ("1.", "2.", "3.", "4.", "5.", "6.", "7.", "8.", "9.", "11.", "12.", "14.", "21.", "22", "23.", "24.",
         "25.", "26.", "28.", "29.", "30.", "31.", "32.", "33.", "34.", "35.", "36.", "38.", "39.", "40.", "41.", "42."))]
    assert not bad, bad
    # The examples run for real where what they need is built: the limiter
    # and the driver double (43a), the daemon (43b, the programs faked).
    examples = {n[:4]: by[n] for n in names if n.startswith("43")}
    if built("libcuda_limiter.so") and double_dir():
        assert examples["43a."]["result"] == "PASS", examples
    if built("hypervisor"):
        assert examples["43b."]["result"] == "PASS", examples
    for r, _, out in runs:
        assert (out / "table.md").read_text().splitlines()[0].startswith("| check | without limiter |")
        assert {p.name for p in out.iterdir()} == {"table.md", "results.json", "e2e.log", "e2e-logs.tar.gz"}
        assert "passed," in r.stdout.splitlines()[-1] or "passed," in r.stdout  # the table is printed at the end
    if built("hypervisor"):
        for n in names:
            if n.startswith(("16.", "17a.", "17b.", "18.", "19.")):
                assert not any(w.startswith("hypervisor did not start") for w in by[n]["reasons"]), by[n]
        out = runs[18 % SHARDS][2]
        st = json.loads(subprocess.run(["tar", "-xzOf", str(out / "e2e-logs.tar.gz"), "e2e-logs/18-suspended-status.json"],
                                       capture_output=True, text=True).stdout)
        assert any(p["id"] == "e2e-c18-a" and p["suspended"] for p in st["pods"])


def test_a_crash_is_a_fail_and_the_run_goes_on(fake_env):
    r, data, _ = run_harness(fake_env, "crash", "--checks", "8 5", FAKEGPU_CRASH="mem_pairs")
    by = {x["check"]: x for x in data["rows"]}
    pairs = by["8. 10k cudaMalloc/cudaFree pairs, 4 threads"]
    assert pairs["result"] == "FAIL" and "base-exit=139" in pairs["reasons"], pairs
    assert by["5. PyTorch mem_get_info / OOM"]["result"] == "PASS"
    assert r.returncode == 1


def test_oversubscription_by_k(fake_env):
    r, data, _ = run_harness(fake_env, "oversub", "-k", "oversub")
    assert [x["check"][:3] for x in data["rows"]] == ["23.", "24.", "25.", "26."], data["rows"]
    assert all(x["result"] == "PASS" for x in data["rows"]), data["rows"]
    assert r.returncode == 0, r.stdout[-3000:]


def test_green_contexts_that_do_not_fit(fake_env):
    """Check 39 when 16 green contexts do not fit the quota without the
    limiter: the limiter refuses (2) the one that does not fit. (The
    default fake's fit, as on the H100: nothing may be refused.)"""
    r, data, _ = run_harness(fake_env, "green", "--checks", "39", FAKEGPU_GREEN_MIB="300")
    [row] = data["rows"]
    assert row["result"] == "PASS" and "op_rc=2" in row["with"] and "contexts=11" in row["with"], row
    assert r.returncode == 0, r.stdout[-3000:]


def test_ipc_import_charged_twice_fails(fake_env):
    """Checks 40 and 41 fail when the limiter charges an import to the importer
    as well as to the exporter."""
    r, data, _ = run_harness(fake_env, "ipc", "-k", "ipc", FAKEGPU_IPC_CHARGED="1")
    assert [x["check"][:3] for x in data["rows"]] == ["40.", "41."], data["rows"]
    for row in data["rows"]:
        assert row["result"] == "FAIL" and "import_rc!=0" in row["reasons"], row
        assert not any(w.startswith("base-") or w.startswith("pre-") for w in row["reasons"]), row
    assert r.returncode == 1


def test_selection_by_k(fake_env):
    r, data, _ = run_harness(fake_env, "k", "-k", "busy_share and 2000us and graph")
    assert [x["check"] for x in data["rows"]] == [f"11. busy share L={L}% kernel 2000us graph" for L in (10, 25, 50, 75)]
    assert r.returncode == 0, r.stdout[-3000:]
