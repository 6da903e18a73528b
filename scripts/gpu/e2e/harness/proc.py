"""Running the check programs with and without the limiter.

Every run writes its own log (a header, the program's stdout and stderr, and
"# exit=N" with the reason when it timed out or died of a signal), as the
bash script did, so the logs read the same. Background runs are tracked and
killed at the end of each check and of the session.
"""

from __future__ import annotations

import glob
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .parse import compute_apps, kv

# Removed from the environment of every run, then set again by the mode.
LIMITER_VARS = (
    "LD_PRELOAD", "CUDA_DEVICE_MEMORY_LIMIT", "CUDA_LIMITER_MEMORY_LIMIT", "CUDA_LIMITER_POD",
    "CUDA_DEVICE_SM_LIMIT", "CUDA_LIMITER_SM_LIMIT", "CUDA_LIMITER_GRANT_TIMEOUT_MS",
    "CUDA_LIMITER_HYPERVISOR", "CUDA_LIMITER_TOKEN", "CUDA_LIMITER_TOKEN_FILE",
    "CUDA_OVERSUBSCRIBE", "CUDA_LIMITER_OVERSUBSCRIBE", "CUDA_LIMITER_SPILL_LIMIT",
)


@dataclass
class Settings:
    """What the runs need to know (from the options and the environment)."""

    lib: str  # libcuda_limiter.so
    bin_dir: Path
    src: Path  # scripts/gpu
    work: Path
    log_dir: Path
    python: str = "python3"
    limiter_log: str = "info"
    sm_var: str = "CUDA_DEVICE_SM_LIMIT"
    share_secs: int = 3
    torch_secs: int = 6
    hypervisor: str = ""
    latency_test: str = ""
    hv_log: str = "info"
    hv_b_weight: int = 1
    hv_simulate: str = ""
    hv_url: str = ""  # the daemon of the running check
    hv_down_url: str = ""
    hv_tokens: dict = field(default_factory=dict)

    def built(self, name: str) -> bool:
        p = self.bin_dir / name
        return p.is_file() and os.access(p, os.X_OK)

    def bin(self, name: str) -> str:
        return str(self.bin_dir / name)

    def script(self, name: str) -> list:
        return [self.python, str(self.src / name)]


def hv_token(pod: str) -> str:
    return f"e2e-tok-{pod}"


def env_for(s: Settings, mode: str, pod: str = "-", log: str | None = None) -> dict:
    """The environment of a run:
    base     without the limiter
    lim      the limiter and the 4 GiB memory quota, pod POD
    over:C   as lim, with oversubscription on (CUDA_OVERSUBSCRIBE=true) and a
             host-memory cap of C (CUDA_LIMITER_SPILL_LIMIT)
    pre      the limiter loaded and active (a 60 GiB quota), no compute limit
    sm:L     the limiter and a compute limit of L percent, pod POD
    hv       the limiter in hypervisor mode (s.hv_url), pod POD and its token
    down:M   hypervisor mode at s.hv_down_url (nothing listens), grant timeout
             2 s, pod POD, local memory limit M (none when M is empty)"""
    env = {k: v for k, v in os.environ.items() if k not in LIMITER_VARS}
    level = log or s.limiter_log
    if mode == "base":
        return env
    env["LD_PRELOAD"] = s.lib
    env["CUDA_LIMITER_LOG"] = level
    if mode == "lim":
        env.update(CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_LIMITER_POD=pod)
    elif mode.startswith("over:"):
        env.update(CUDA_DEVICE_MEMORY_LIMIT="4g", CUDA_LIMITER_POD=pod, CUDA_OVERSUBSCRIBE="true",
                   CUDA_LIMITER_SPILL_LIMIT=mode[5:])
    elif mode == "pre":
        env.update(CUDA_DEVICE_MEMORY_LIMIT="60g", CUDA_LIMITER_POD="e2e-pre")
    elif mode.startswith("sm:"):
        env.update({s.sm_var: mode[3:], "CUDA_LIMITER_POD": pod})
    elif mode == "hv":
        env.update(CUDA_LIMITER_POD=pod, CUDA_LIMITER_HYPERVISOR=s.hv_url, CUDA_LIMITER_TOKEN=hv_token(pod))
    elif mode.startswith("down:"):
        env.update(CUDA_LIMITER_POD=pod, CUDA_LIMITER_HYPERVISOR=s.hv_down_url,
                   CUDA_LIMITER_TOKEN="e2e-down", CUDA_LIMITER_GRANT_TIMEOUT_MS="2000")
        if mode[5:]:
            env["CUDA_DEVICE_MEMORY_LIMIT"] = mode[5:]
    else:
        raise ValueError(f"unknown run mode {mode!r}")
    return env


def stamp() -> str:
    t = time.time()
    return time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1e9):09d}"


# The node's activity and priority tables under the harness's own names, for
# every run and hypervisor of the session: the machine's default tables are
# left alone, and the session removes its own at the end.
NODE_TABLES = {"GPUSHARE_NODE_REGION": "gpushare-node-e2e", "GPUSHARE_PRIORITY_REGION": "gpushare-priority-e2e"}


def use_own_node_tables() -> None:
    """Names the node's tables for the session (a name set already stays)."""
    for var, name in NODE_TABLES.items():
        os.environ.setdefault(var, name)


def remove_own_node_tables() -> None:
    for name in NODE_TABLES.values():
        try:
            os.unlink(f"/dev/shm/{name}")
        except OSError:
            pass


def gpu_count() -> int:
    """The GPUs nvidia-smi lists (1 when it lists none: the checks' device 0)."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return 1
    return max(1, sum(line.startswith("GPU ") for line in out.splitlines()))


def clean_shm() -> None:
    """Every pod of the harness is named e2e-*: other users' regions stay."""
    for p in glob.glob("/dev/shm/gpushare-pod-e2e-*") + glob.glob("/dev/shm/gpushare-limits-e2e-*"):
        try:
            os.unlink(p)
        except OSError:
            pass


class Output:
    """A run's log: its key=value output and exit status."""

    log: Path
    rc: int | None = None

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def kv(self, key: str) -> str | None:
        return kv(self.text(), key)

    def timed_out(self) -> bool:
        return self.rc in (124, 137)

    def exit_why(self, tag: str) -> str:
        """"TAG-exit=N" when the run did not exit 0."""
        return "" if self.rc == 0 else f"{tag}-exit={'?' if self.rc is None else self.rc}"

    def spin_why(self, tag: str) -> str:
        """Reasons a spin-like log is unusable: it did not exit 0, or no ok=1."""
        return " ".join(x for x in (self.exit_why(tag), "" if self.kv("ok") == "1" else f"{tag}-not-ok") if x)


class Log(Output):
    """The log of an earlier run (its exit status from its "# exit=N" line)."""

    def __init__(self, log: Path):
        self.log = Path(log)
        m = re.search(r"^# exit=([0-9]+)", self.text(), re.MULTILINE)
        self.rc = int(m.group(1)) if m else None


class Proc(Output):
    """One program run, in the foreground (run()) or the background (start()).
    env: its whole environment instead of the mode's (mode is then only a
    label in the log); stdin: a pipe that tell() writes to."""

    live: set[Proc] = set()

    def __init__(self, s: Settings, mode: str, pod: str, log: Path, timeout: float, cmd: Sequence[str],
                 limiter_log: str | None = None, cwd: str | None = None, header: str = "",
                 env: dict | None = None, stdin: bool = False):
        self.mode, self.pod, self.log, self.timeout, self.cmd = mode, pod, Path(log), timeout, list(cmd)
        self.env = dict(env) if env is not None else env_for(s, mode, pod, limiter_log)
        self.cwd = cwd
        self.header = header
        self.stdin = stdin
        self.p: subprocess.Popen | None = None
        self.rc: int | None = None
        self.note = ""

    def start(self) -> Proc:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            f.write(f"# mode={self.mode} pod={self.pod} timeout={self.timeout:g}s{self.header}\n")
            extra = " ".join(f"{k}={v}" for k, v in sorted(self.env.items())
                             if k in LIMITER_VARS or k.startswith("CUDA_LIMITER"))
            f.write(f"# cmd: {extra} {' '.join(self.cmd)}\n# start {stamp()}\n")
        self.deadline = time.time() + self.timeout
        out = open(self.log, "a")
        try:
            self.p = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                      cwd=self.cwd, start_new_session=True,
                                      stdin=subprocess.PIPE if self.stdin else subprocess.DEVNULL,
                                      text=True)
        except OSError as e:
            out.write(f"cannot start: {e}\n")
            out.close()
            self._ended(127)
            return self
        out.close()
        Proc.live.add(self)
        return self

    @property
    def pid(self) -> int | None:
        return self.p.pid if self.p else None

    def alive(self) -> bool:
        return self.p is not None and self.rc is None and self.p.poll() is None

    def tell(self, text: str) -> bool:
        """Writes text to its stdin (a Proc made with stdin=True); False when it is gone."""
        try:
            self.p.stdin.write(text)
            self.p.stdin.flush()
            return True
        except (AttributeError, OSError):
            return False

    def wait(self) -> int:
        """Until it exits or its time is up (then SIGTERM, SIGKILL 5 s later)."""
        if self.rc is not None:
            return self.rc
        if self.p is None:
            return self._ended(127)
        try:
            rc = self.p.wait(timeout=max(0.0, self.deadline - time.time()))
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=5)
                rc = 124
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.p.wait()
                rc = 137
            self.note = f" (TIMEOUT after {self.timeout:g}s)"
        return self._ended(rc)

    def kill(self, sig=signal.SIGKILL) -> None:
        """Signal the program itself (not its group)."""
        if self.alive():
            try:
                self.p.send_signal(sig)
            except OSError:
                pass

    def stop(self) -> None:
        """The end of a check: whatever is left is terminated, then killed."""
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.p.wait()
            self.note = " (stopped by the harness)"
        if self.p is not None and self.rc is None:
            self._ended(self.p.wait())

    def _signal(self, sig) -> None:
        try:
            os.killpg(self.p.pid, sig)
        except OSError:
            pass

    def _ended(self, rc: int) -> int:
        if rc < 0:  # killed by a signal: the shell's 128 + N
            rc = 128 - rc
        if rc > 128 and rc != 137 and not self.note:
            self.note = f" (killed by signal {rc - 128})"
        self.rc = rc
        Proc.live.discard(self)
        if self.p is not None and self.p.stdin:
            try:
                self.p.stdin.close()
            except OSError:
                pass
        with open(self.log, "a") as f:
            f.write(f"# exit={rc} end {stamp()}{self.note}\n")
        return rc

    def wait_for_line(self, *prefixes: str, limit_s: float = 60.0) -> bool:
        """Until a line starts with one of prefixes, or it exits, or limit_s."""
        end = time.time() + limit_s
        while time.time() < end:
            for line in self.text().splitlines():
                if line.startswith(prefixes):
                    return True
            if not self.alive():
                return False
            time.sleep(0.1)
        return False


def wait_ready(procs, limit_s: float) -> bool:
    """Until every process printed ready=1; False when one exited first, or after limit_s."""
    end = time.time() + limit_s
    while time.time() < end:
        if all(re.search(r"^ready=1", p.text(), re.MULTILINE) for p in procs):
            return True
        if any(not p.alive() for p in procs):
            return False
        time.sleep(0.1)
    return False


def wait_holding(a: Proc, limit_s: float = 60.0) -> None:
    """Until mem_hold holds its memory, its allocation failed, or it exited."""
    end = time.time() + limit_s
    while time.time() < end and a.alive():
        t = a.text()
        if re.search(r"^holding=1", t, re.MULTILINE):
            return
        m = re.search(r"^alloc_rc=(.*)$", t, re.MULTILINE)
        if m and m.group(1).strip() != "0":
            return
        time.sleep(0.1)


SMI_MEM = ["nvidia-smi", "-i", "0", "--query-gpu=memory.total,memory.used,memory.free",
           "--format=csv,noheader,nounits"]
SMI_APPS = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]


def footprints(s: Settings) -> dict:
    """Every compute process's device memory as NVML sees it from outside
    (nvidia-smi), MiB by pid; {} when nvidia-smi does not answer."""
    try:
        text = subprocess.run(SMI_APPS, capture_output=True, text=True, timeout=30, env=env_for(s, "base")).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return compute_apps(text)


def run(s: Settings, mode: str, pod: str, log: Path, timeout: float, cmd: Sequence[str], **kw) -> Proc:
    """Runs cmd to its end; the Proc holds the exit status and the log."""
    p = Proc(s, mode, pod, log, timeout, cmd, **kw).start()
    p.wait()
    return p


def stop_all() -> None:
    for p in list(Proc.live):
        p.stop()
