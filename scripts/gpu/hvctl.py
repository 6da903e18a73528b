#!/usr/bin/env python3
"""Checks 16-20: talks to the hypervisor's HTTP API, prints key=value lines.

  hvctl.py URL wait-up SECONDS                 poll GET /api/v1/status until it answers 200
  hvctl.py URL status [JSON_OUT]               summary of GET /api/v1/status (JSON saved)
  hvctl.py URL admin TOKEN ACTION POD [AT]     POST /api/v1/pods/POD/ACTION (suspend, resume),
                                               at epoch second AT when given (the
                                               interpreter's start-up is then not in the timing)
  hvctl.py URL wait-workers UNTIL_EPOCH POD... poll the status (every 20 ms) until every POD
                                               has a worker listed, or UNTIL_EPOCH
  hvctl.py - latency LOG                       p50/p99 from the output of the hypervisor's
                                               latency benchmark (benches/admission_latency.rs)

Only the standard library; proxies from the environment are ignored. Every
command ends with ok=1 when it got what it asked for, ok=0 otherwise (exit
status 0 either way; 2 on a usage error). The GPU harness (scripts/gpu/e2e)
imports the cmd_* functions, which return those lines as a dict.
"""

import json
import re
import sys
import time
import urllib.error
import urllib.request

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(url, method="GET", token=None, timeout=2.0, body=None):
    """(status, body text); status 0 when there was no answer. `body`: a
    JSON text posted as such."""
    data = body.encode() if body is not None else (b"" if method == "POST" else None)
    req = urllib.request.Request(url, method=method, data=data)
    if body is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with OPENER.open(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return 0, str(reason)


def one_line(text, limit=300):
    text = " ".join(str(text).split())
    return text[:limit]


def get_status(base, timeout=2.0):
    code, body = request(f"{base}/api/v1/status", timeout=timeout)
    if code != 200:
        return None, code, body
    try:
        return json.loads(body), code, body
    except ValueError:
        return None, code, body


class Lines(dict):
    """The key=value lines of a command, in order; a repeated key keeps its first value."""

    def line(self, text):
        key, _, value = text.partition("=")
        self.setdefault(key, value)

    def text(self):
        return "".join(f"{k}={v}\n" for k, v in self.items())


def cmd_wait_up(base, secs):
    r = Lines()
    t0 = time.time()
    deadline = t0 + float(secs)
    code, body = 0, ""
    while time.time() < deadline:
        status, code, body = get_status(base, timeout=1.0)
        if status is not None:
            r.line(f"up_ms={(time.time() - t0) * 1000:.0f}")
            r.line(f"instance={status.get('instance', '')}")
            r.line("ok=1")
            return r
        time.sleep(0.05)
    r.line(f"http_status={code}")
    r.line(f"last_answer={one_line(body)}")
    r.line("ok=0")
    return r


def cmd_status(base, json_out=None):
    r = Lines()
    status, code, body = get_status(base)
    r.line(f"at_epoch={time.time():.6f}")
    r.line(f"http_status={code}")
    if status is None:
        r.line(f"last_answer={one_line(body)}")
        r.line("ok=0")
        return r
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(status, f, indent=1)
    r.line(f"instance={status.get('instance', '')}")
    gpus = status.get("gpus") or []
    r.line(f"gpus={len(gpus)}")
    for g in gpus:
        r.line(f"gpu{g.get('index')}_uuid={g.get('uuid')}")
    for pod in status.get("pods") or []:
        pid = pod.get("id", "?")
        r.line(f"pod_{pid}_suspended={1 if pod.get('suspended') else 0}")
        r.line(f"pod_{pid}_workers={pod.get('workers', 0)}")
        pg = pod.get("gpus") or []
        # Placed: the pod's GPU resolved to a device UUID (quotas follow
        # UUIDs; status has no CUDA ordinal).
        placed = bool(pg) and pg[0].get("uuid") is not None
        r.line(f"pod_{pid}_placed={1 if placed else 0}")
        if pg:
            g = pg[0]
            for key in ("policy", "weight", "cap_percent", "share_percent", "rate_ppm", "ceiling_ppm",
                        "achieved_ppm", "waiting", "launches", "tokens_ns", "ordinal", "uuid"):
                r.line(f"pod_{pid}_{key}={g.get(key)}")
            r.line(f"pod_{pid}_active={1 if g.get('active') else 0}")
    workers = status.get("workers") or []
    r.line(f"workers_total={len(workers)}")
    r.line(f"worker_pods={','.join(sorted({w.get('pod', '?') for w in workers}))}")
    r.line(f"workers_adopted={sum(1 for w in workers if w.get('adopted'))}")
    adm = status.get("admission") or {}
    r.line(f"admission_count={adm.get('count')}")
    r.line(f"admission_timeouts={adm.get('timeouts')}")
    r.line("ok=1")
    return r


def cmd_admin(base, token, action, pod, at=None):
    r = Lines()
    if at is not None:
        delay = float(at) - time.time()
        if delay > 0:
            time.sleep(delay)
    t0 = time.time()
    code, body = request(f"{base}/api/v1/pods/{pod}/{action}", method="POST", token=token, timeout=5.0)
    t1 = time.time()
    r.line(f"sent_epoch={t0:.6f}")
    r.line(f"at_epoch={t1:.6f}")
    r.line(f"elapsed_ms={(t1 - t0) * 1000:.1f}")
    r.line(f"http_status={code}")
    r.line(f"answer={one_line(body)}")
    r.line(f"ok={1 if code == 200 else 0}")
    return r


def cmd_wait_workers(base, until, pods):
    r = Lines()
    until = float(until)
    want = set(pods)
    polls = errors = 0
    seen = set()
    adopted = 0
    while True:
        polls += 1
        status, _, _ = get_status(base, timeout=0.5)
        now = time.time()
        if status is None:
            errors += 1
        else:
            workers = status.get("workers") or []
            seen = {w.get("pod") for w in workers} & want
            adopted = sum(1 for w in workers if w.get("adopted"))
            if seen == want:
                r.line(f"seen_epoch={now:.6f}")
                r.line(f"polls={polls}")
                r.line(f"errors={errors}")
                r.line(f"workers_total={len(workers)}")
                r.line(f"workers_adopted={adopted}")
                r.line("ok=1")
                return r
        if now >= until:
            break
        time.sleep(0.02)
    r.line(f"polls={polls}")
    r.line(f"errors={errors}")
    r.line(f"seen_pods={','.join(sorted(seen))}")
    r.line(f"workers_adopted={adopted}")
    r.line("ok=0")
    return r


UNIT_US = {"ns": 1e-3, "µs": 1.0, "μs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
DUR = r"([0-9]+(?:\.[0-9]+)?)(ns|µs|μs|us|ms|s)"


def us(value, unit):
    return float(value) * UNIT_US[unit]


def cmd_latency(log):
    r = Lines()
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        r.line(f"error=cannot read {log}: {e.strerror}")
        r.line("ok=0")
        return r
    found = False
    for line in text.splitlines():
        if "admission latency" in line:
            m = re.search(r"p50 " + DUR + r", p99 " + DUR, line)
            if m and not found:
                found = True
                r.line(f"p50_us={us(m.group(1), m.group(2)):.1f}")
                r.line(f"p99_us={us(m.group(3), m.group(4)):.1f}")
            m = re.search(r"p99 [^,]*, max " + DUR, line)
            if m:
                r.line(f"max_us={us(m.group(1), m.group(2)):.1f}")
            m = re.search(r"/healthz p50 " + DUR + r", p99 " + DUR, line)
            if m:
                r.line(f"healthz_p50_us={us(m.group(1), m.group(2)):.1f}")
                r.line(f"healthz_p99_us={us(m.group(3), m.group(4)):.1f}")
            m = re.search(r"(unoptimized|optimized) build", line)
            if m:
                r.line(f"build={m.group(1)}")
        elif "concurrent clients" in line:
            m = re.search(r"p50 " + DUR + r", p99 " + DUR, line)
            if m:
                r.line(f"concurrent_p50_us={us(m.group(1), m.group(2)):.1f}")
                r.line(f"concurrent_p99_us={us(m.group(3), m.group(4)):.1f}")
    # "server side p50 ≤ 50 µs, p99 ≤ 100 µs" (older builds: "≤ Some(50) µs")
    m = re.search(r"server[- ]side[^\n]*?p50 ≤ (?:Some\()?(\d+)\)? ?[µμu]s, p99 ≤ (?:Some\()?(\d+)\)? ?[µμu]s", text)
    if m:
        r.line(f"server_p50_us={m.group(1)}")
        r.line(f"server_p99_us={m.group(2)}")
    m = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed", text)
    if m:
        r.line(f"tests_passed={m.group(2)}")
        r.line(f"tests_failed={m.group(3)}")
    r.line(f"ok={1 if found else 0}")
    return r


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    base, cmd, rest = argv[0].rstrip("/"), argv[1], argv[2:]
    try:
        if cmd == "wait-up" and len(rest) == 1:
            r = cmd_wait_up(base, rest[0])
        elif cmd == "status" and len(rest) <= 1:
            r = cmd_status(base, rest[0] if rest else None)
        elif cmd == "admin" and len(rest) in (3, 4):
            r = cmd_admin(base, *rest)
        elif cmd == "wait-workers" and len(rest) >= 2:
            r = cmd_wait_workers(base, rest[0], rest[1:])
        elif cmd == "latency" and len(rest) == 1:
            r = cmd_latency(rest[0])
        else:
            print(__doc__, file=sys.stderr)
            return 2
        print(r.text(), end="")
    except (ValueError, KeyError, TypeError) as e:
        print(f"error={one_line(e)}")
        print("ok=0")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
