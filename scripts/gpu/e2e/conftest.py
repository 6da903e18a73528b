"""The GPU end-to-end harness: options, the per-check context, the report.

  python3 -m pytest scripts/gpu/e2e --bundle gpu-bundle --bin-dir BIN [-k ...]
  (scripts/gpu/run.sh builds BIN with nvcc and calls this)

Every check runs the same program WITHOUT and WITH the limiter and records
rows (check, without, with, expected, result). A check that crashes is
recorded as FAIL with the exception as its reason, and the run goes on.
At the end: $OUT/table.md, $OUT/results.json, $OUT/e2e.log (progress and
every step's log) and $OUT/e2e-logs.tar.gz; the table is printed last.

Knobs, as options or in the environment (the option wins):
  --checks "1 4 7"   E2E_ONLY          only these checks (numbers as in the table)
  --bin-dir DIR      E2E_BIN_DIR       the built CUDA programs
  CUDA_LIMITER_LOG   limiter log level for the limited runs (default info)
  PYTHON             python with torch (default: this interpreter)
  E2E_SM_VAR         compute-limit variable (default CUDA_DEVICE_SM_LIMIT)
  --share-secs N     E2E_SHARE_SECS    seconds per spin run in checks 11, 12, 15 (3)
  --torch-secs N     E2E_TORCH_SECS    timed seconds per matmul run in check 13 (6)
  E2E_HYPERVISOR     the daemon binary (default <bundle>/hypervisor)
  E2E_HV_LOG         the daemon's HYPERVISOR_LOG (default info)
  E2E_HV_B_WEIGHT    pod B's weight in check 17b (default 1)
  E2E_HV_SIMULATE=1  the daemon simulates the GPU (--simulate-gpus 1)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import proc
from harness.report import Progress, Recorder

SRC = Path(__file__).resolve().parents[1]  # scripts/gpu


def pytest_addoption(parser):
    g = parser.getgroup("gpu-e2e")
    g.addoption("--bundle", default=os.environ.get("E2E_BUNDLE", ""), help="dir with libcuda_limiter.so")
    g.addoption("--bin-dir", default=os.environ.get("E2E_BIN_DIR", ""), help="the built CUDA programs")
    g.addoption("--checks", default=os.environ.get("E2E_ONLY", ""), help='only these checks, e.g. "1 4 7"')
    g.addoption("--share-secs", default=os.environ.get("E2E_SHARE_SECS", "3"))
    g.addoption("--torch-secs", default=os.environ.get("E2E_TORCH_SECS", "6"))
    g.addoption("--out", default=os.environ.get("OUT", ""), help="results dir (default: the work dir)")
    g.addoption("--work", default=os.environ.get("E2E_WORK", ""), help="work dir (default: a new /tmp one)")


def pytest_configure(config):
    config.addinivalue_line("markers", "check(n): the check number in the table")


def _posint(text, default):
    return int(text) if re.fullmatch(r"[1-9][0-9]*", str(text or "")) else default


def pytest_collection_modifyitems(config, items):
    only = set(re.split(r"[ ,]+", config.getoption("--checks").strip())) - {""}
    if not only:
        return
    keep, drop = [], []
    for it in items:
        m = it.get_closest_marker("check")
        (keep if m and str(m.args[0]) in only else drop).append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class Session:
    """State of one harness run."""

    def __init__(self, config):
        bundle = config.getoption("--bundle")
        if not bundle:
            raise pytest.UsageError("--bundle <dir containing libcuda_limiter.so> is required")
        bundle = Path(bundle).resolve()
        lib = bundle / "libcuda_limiter.so" if bundle.is_dir() else bundle
        bdir = bundle if bundle.is_dir() else bundle.parent
        work = Path(config.getoption("--work") or tempfile.mkdtemp(prefix="gpu-e2e."))
        self.work = work
        self.log_dir = work / "e2e-logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.out = Path(config.getoption("--out") or work)
        self.out.mkdir(parents=True, exist_ok=True)
        hv = os.environ.get("E2E_HYPERVISOR") or str(bdir / "hypervisor")
        self.s = proc.Settings(
            lib=str(lib), bin_dir=Path(config.getoption("--bin-dir") or work / "bin"), src=SRC, work=work,
            log_dir=self.log_dir, python=os.environ.get("PYTHON") or sys.executable,
            limiter_log=os.environ.get("CUDA_LIMITER_LOG") or "info",
            sm_var=os.environ.get("E2E_SM_VAR") or "CUDA_DEVICE_SM_LIMIT",
            share_secs=_posint(config.getoption("--share-secs"), 3),
            torch_secs=_posint(config.getoption("--torch-secs"), 6),
            hypervisor=self._copy_exe(hv, "hypervisor"),
            latency_test=self._copy_exe(str(bdir / "hypervisor-admission-latency"), "hypervisor-admission-latency"),
            hv_log=os.environ.get("E2E_HV_LOG") or "info",
            hv_b_weight=_posint(os.environ.get("E2E_HV_B_WEIGHT"), 1),
            hv_simulate=os.environ.get("E2E_HV_SIMULATE", "") if re.fullmatch(r"[1-9]", os.environ.get(
                "E2E_HV_SIMULATE", "")) else "",
        )
        self.progress = Progress(echo=self._echo)
        self.rec = Recorder(self.progress)
        self.t0 = time.time()
        self.tr = config.pluginmanager.get_plugin("terminalreporter")

    def _echo(self, text):
        tr = getattr(self, "tr", None)
        if tr is not None:
            tr.write_line(text)
        else:
            print(text, flush=True)

    def _copy_exe(self, src, name) -> str:
        """An executable copy in the work dir (bundles lose the x bit), or ""."""
        if not os.path.isfile(src):
            return ""
        dst = self.work / name
        shutil.copyfile(src, dst)
        dst.chmod(0o755)
        return str(dst)

    def preflight(self):
        s = self.s
        cmds = [["uname", "-a"], ["git", "-C", str(SRC), "rev-parse", "HEAD"], ["ls", "-la", s.lib],
                ["sha256sum", s.lib], ["nvidia-smi"],
                ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv"],
                [s.python, "-c", "import sys, torch; print(sys.version); print('torch', torch.__version__, "
                                 "'cuda', torch.version.cuda)"], ["ls", "-la", "/dev/shm"]]
        if s.hypervisor:
            cmds.append([s.hypervisor, "--version"])
        with open(self.log_dir / "00-preflight.log", "w") as f:
            f.write(f"date: {time.ctime()}\nlimiter: {s.lib}\nbin: {s.bin_dir}\n"
                    f"hypervisor: {s.hypervisor or '(none)'}\nlatency test: {s.latency_test or '(none)'}\n")
            for c in cmds:
                f.write(f"--- {' '.join(c)}\n")
                f.flush()
                try:
                    subprocess.run(c, stdout=f, stderr=subprocess.STDOUT, timeout=60,
                                   env=proc.env_for(s, "base"))
                except (OSError, subprocess.SubprocessError) as e:
                    f.write(f"{e}\n")
        say = self.progress.say
        say(f"limiter: {s.lib}")
        say(f"work dir: {self.work}   results: {self.out}")
        if not os.path.isfile(s.lib):
            say(f"ERROR: {s.lib} does not exist; every limited run will fail")
            p = self.rec.plan("0. limiter library present", "file exists", "preflight")
            p.done("-", "missing", f"no-{s.lib}")
        try:
            apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                                  capture_output=True, text=True, timeout=30, env=proc.env_for(s, "base")).stdout
            n = sum(1 for line in apps.splitlines() if re.search(r"[0-9]", line))
            if n:
                say(f"WARNING: {n} other process(es) already use the GPU; baseline numbers may be off")
        except (OSError, subprocess.SubprocessError):
            pass

    def finish(self):
        self.rec.close_test("preflight", None)
        proc.stop_all()
        proc.clean_shm()
        table = self.rec.table()
        (self.out / "table.md").write_text(table)
        meta = {"limiter": self.s.lib, "work": str(self.work), "host": os.uname().nodename}
        (self.out / "results.json").write_text(self.rec.json(meta))
        with open(self.out / "e2e.log", "w") as f:
            f.write("\n".join(self.progress.lines) + "\n")
            for p in sorted(self.log_dir.iterdir()):
                if not p.is_file() or p.suffix == ".intervals":
                    continue
                lines = p.read_text(errors="replace").splitlines()
                f.write(f"\n===================== {p.name} ({len(lines)} lines)\n")
                if len(lines) > 3000:
                    lines = lines[:1500] + ["[... cut ...]"] + lines[-1500:]
                f.write("\n".join(lines) + "\n")
            f.write("\n===================== table\n" + table)
        with tarfile.open(self.out / "e2e-logs.tar.gz", "w:gz") as t:
            t.add(self.log_dir, arcname="e2e-logs")
        return table


SESSION: Session | None = None


def pytest_sessionstart(session):
    global SESSION
    if session.config.option.collectonly:
        return
    proc.use_own_node_tables()
    SESSION = Session(session.config)
    SESSION.preflight()
    proc.clean_shm()


def pytest_sessionfinish(session, exitstatus):
    if SESSION is None:
        return
    table = SESSION.finish()
    proc.remove_own_node_tables()
    passed, failed = SESSION.rec.counts()
    SESSION.progress.say(f"\nlogs: {SESSION.log_dir}  combined: {SESSION.out / 'e2e.log'}  "
                         f"table: {SESSION.out / 'table.md'}  ({time.time() - SESSION.t0:.0f} s)\n")
    SESSION.progress.say(table)
    if failed or not passed:
        session.exitstatus = 1


class Check:
    """What a check function gets: the settings, rows to fill, progress lines."""

    def __init__(self, sess: Session, test: str):
        self.sess, self.s, self.test = sess, sess.s, test
        self.say = sess.progress.say
        self.log = sess.log_dir

    def row(self, name: str, expected: str):
        return self.sess.rec.plan(name, expected, self.test)


@pytest.fixture
def check(request):
    assert SESSION is not None
    c = Check(SESSION, request.node.nodeid)
    t0 = time.time()
    SESSION.progress.say(f"== {request.node.name} ({time.strftime('%H:%M:%S')})")
    proc.clean_shm()
    yield c
    proc.stop_all()
    proc.clean_shm()
    SESSION.progress.say(f"   {request.node.name} took {time.time() - t0:.0f} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if SESSION is None or rep.when != "call":
        return
    crash = None
    if call.excinfo is not None:
        e = call.excinfo.value
        tb = traceback.extract_tb(call.excinfo.tb)
        where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
        crash = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}{where}"
    rows = SESSION.rec.close_test(item.nodeid, crash)
    bad = [r for r in rows if r.result == "FAIL"]
    if rep.passed and bad:
        rep.outcome = "failed"
        rep.longrepr = "\n".join(f"{r.check}: {' '.join(r.reasons)}" for r in bad)
