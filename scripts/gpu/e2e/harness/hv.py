"""The node daemon for checks 16-19 and the co-run benchmarks: config, start
on a port the harness picks, status, admin calls, reload, stop and kill, and
the timeline of a check (t = seconds after the go file released the spin
processes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .checks import num
from .proc import Settings, hv_token, stamp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # scripts/gpu: hvctl, hv_intervals
import hvctl


def free_port() -> int:
    """A port nothing listens on now: the kernel picks it for a socket bound to
    port 0, which is then closed (the daemon binds it with SO_REUSEADDR)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pod_section(pod: str, *lines: str, gpu: int = 0) -> str:
    """One [[pods]] section on GPU index `gpu`."""
    body = "\n".join(lines)
    return f'[[pods]]\nid = "{pod}"\ntoken = "{hv_token(pod)}"\n[[pods.gpus]]\nindex = {gpu}\n{body}\n\n'


def write_config(path: Path, admin: str, *sections: str) -> Path:
    path.write_text("# written by scripts/gpu/e2e\n" 'listen = "127.0.0.1:0"\n'
                    f'admin_token = "{admin}"\n\n' + "".join(sections))
    return path


class HvError(RuntimeError):
    pass


class Daemon:
    """One hypervisor process (restart() starts another on the same port).

    serve_args: more arguments of `serve` (co-run: --corun-gpu ...); env: more
    variables for it; ready: a path that must answer 200 within ready_s once
    the status answers (co-run: /readyz, the MPS daemon up); stop_s: how long
    stop() waits after SIGTERM. say: progress lines (default: the log)."""

    def __init__(self, s: Settings, tag: str, config: Path, say=None, *, serve_args=(), env=None,
                 ready: str | None = None, ready_s: float = 60.0, stop_s: float = 3.0):
        self.s, self.tag, self.config = s, tag, config
        self.say = say or (lambda text: self.note(text.strip()))
        self.serve_args, self.extra_env = list(serve_args), dict(env or {})
        self.ready, self.ready_s, self.stop_s = ready, ready_s, stop_s
        self.p: subprocess.Popen | None = None
        self.port: int | None = None
        self.log = s.log_dir / f"{tag}-hypervisor.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None) -> None:
        """Starts serve on `port` (a restart) or on a free port (three tries if
        another process takes it first); returns once its status answers."""
        restart = port is not None
        if restart:
            self.log = self.s.log_dir / f"{self.tag}-hypervisor-restart.log"
        with open(self.log, "w") as f:
            f.write(f"# config {self.config}:\n{self.config.read_text()}")
            if not restart:
                f.write("# hypervisor check-config:\n")
                f.flush()
                r = subprocess.run([self.s.hypervisor, "check-config", "--config", str(self.config)],
                                   stdout=f, stderr=subprocess.STDOUT, env=self._env(), timeout=20)
                f.write(f"# check-config exit={r.returncode}\n")
        err = ""
        for _ in range(1 if restart else 3):
            self.port = port or free_port()
            err = self._serve()
            if not err:
                return
        raise HvError(err)

    def _env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
        env["HYPERVISOR_LOG"] = self.s.hv_log
        env.update(self.extra_env)
        return env

    def _serve(self) -> str:
        args = [self.s.hypervisor, "serve", "--config", str(self.config), "--listen", f"127.0.0.1:{self.port}"]
        if self.s.hv_simulate:
            args += ["--simulate-gpus", self.s.hv_simulate]
        args += self.serve_args
        with open(self.log, "a") as f:
            f.write(f"# serve start {stamp()} on port {self.port}\n")
            f.flush()
            self.p = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=self._env(),
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        t0 = time.time()
        while time.time() - t0 < 15:
            if self.p.poll() is not None:
                tail = " ".join(self.log.read_text(errors="replace").splitlines()[-2:])[:200]
                return f"hypervisor did not start (exit {self.p.returncode}): {tail}"
            r = hvctl.cmd_wait_up(self.url, 0.5)
            if r.get("ok") == "1":
                self.say(f"   hypervisor pid {self.p.pid} on {self.url} (status answered after "
                         f"{(time.time() - t0) * 1000:.0f} ms)")
                if self.ready and not self._wait_ready():
                    self.stop()
                    # Not a port taken by another process: no retry.
                    raise HvError(f"hypervisor {self.ready} not ready after {self.ready_s:g} s on {self.url}")
                return ""
        self.stop()
        return f"hypervisor status does not answer on {self.url}"

    def _wait_ready(self) -> bool:
        end = time.time() + self.ready_s
        while time.time() < end:
            if self.p.poll() is not None:
                return False
            if hvctl.request(self.url + self.ready, timeout=2.0)[0] == 200:
                return True
            time.sleep(0.2)
        return False

    def kill9(self) -> None:
        if self.p and self.p.poll() is None:
            self.p.send_signal(signal.SIGKILL)
            self.p.wait()

    def stop(self) -> None:
        """SIGTERM, SIGKILL after stop_s (3 s), reaped."""
        if not self.p:
            return
        note = ""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
                note = f" after SIGKILL ({self.stop_s:g} s)"
        with open(self.log, "a") as f:
            f.write(f"# stopped {stamp()} (exit {self.p.returncode}){note}\n")
        self.p = None

    def note(self, text: str) -> None:
        with open(self.log, "a") as f:
            f.write(f"# {text}\n")

    def reload(self) -> None:
        """SIGHUP: the daemon reads its config file again."""
        if self.p and self.p.poll() is None:
            self.p.send_signal(signal.SIGHUP)

    # the API
    def status_json(self) -> dict:
        """GET /api/v1/status, parsed; HvError when it does not answer."""
        st, code, body = hvctl.get_status(self.url, timeout=5.0)
        if st is None:
            raise HvError(f"hypervisor status on {self.url}: {code} {hvctl.one_line(body, 200)}")
        return st

    def status(self, tag: str) -> dict:
        """A status snapshot, also saved as TAG-status.log (key=value) and .json."""
        r = hvctl.cmd_status(self.url, str(self.s.log_dir / f"{tag}-status.json"))
        (self.s.log_dir / f"{tag}-status.log").write_text(r.text())
        return r

    def placed(self, tag: str, *pods: str) -> list:
        st = self.status(tag)
        return [f"{p}-not-placed" for p in pods if st.get(f"pod_{p}_placed") != "1"]

    def admin(self, token: str, action: str, pod: str, at: float, tag: str) -> dict:
        r = hvctl.cmd_admin(self.url, token, action, pod, at)
        (self.s.log_dir / f"{tag}.log").write_text(r.text())
        return r

    def wait_workers(self, until: float, pods, tag: str) -> dict:
        r = hvctl.cmd_wait_workers(self.url, until, list(pods))
        (self.s.log_dir / f"{tag}.log").write_text(r.text())
        return r


def registered(status: dict, *pods: str) -> list:
    """Reasons when a pod has no worker listed."""
    out = []
    for p in pods:
        n = num(status.get(f"pod_{p}_workers"))
        if n is None or n < 1:
            out.append(f"{p}-no-worker-registered")
    return out


class Timeline:
    """t = 0 when go() released the processes."""

    def __init__(self):
        self.t_go: float | None = None

    def go(self, *files: Path) -> None:
        for f in files:
            f.touch()
        self.t_go = time.time()

    def abs(self, t: float) -> float:
        return self.t_go + t

    def sleep_until(self, t: float) -> None:
        d = self.t_go + t - time.time()
        if d > 0:
            time.sleep(d)

    def since(self, epoch) -> str:
        e = num(epoch)
        return "?" if e is None or self.t_go is None else f"{e - self.t_go:.3f}"

    def now(self) -> str:
        return self.since(time.time())
