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
                                               latency test (tests/latency.rs)

Only the standard library; proxies from the environment are ignored. Every
command ends with ok=1 when it got what it asked for, ok=0 otherwise (exit
status 0 either way; 2 on a usage error).
"""

import json
import re
import sys
import time
import urllib.error
import urllib.request

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def request(url, method="GET", token=None, timeout=2.0):
    """(status, body text); status 0 when there was no answer."""
    req = urllib.request.Request(url, method=method, data=b"" if method == "POST" else None)
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


def cmd_wait_up(base, secs):
    t0 = time.time()
    deadline = t0 + float(secs)
    code, body = 0, ""
    while time.time() < deadline:
        status, code, body = get_status(base, timeout=1.0)
        if status is not None:
            print(f"up_ms={(time.time() - t0) * 1000:.0f}")
            print(f"instance={status.get('instance', '')}")
            print("ok=1")
            return
        time.sleep(0.05)
    print(f"http_status={code}")
    print(f"last_answer={one_line(body)}")
    print("ok=0")


def cmd_status(base, json_out=None):
    status, code, body = get_status(base)
    print(f"at_epoch={time.time():.6f}")
    print(f"http_status={code}")
    if status is None:
        print(f"last_answer={one_line(body)}")
        print("ok=0")
        return
    if json_out:
        with open(json_out, "w", encoding="utf-8") as f:
            json.dump(status, f, indent=1)
    print(f"instance={status.get('instance', '')}")
    gpus = status.get("gpus") or []
    print(f"gpus={len(gpus)}")
    for g in gpus:
        print(f"gpu{g.get('index')}_uuid={g.get('uuid')}")
    for pod in status.get("pods") or []:
        pid = pod.get("id", "?")
        print(f"pod_{pid}_suspended={1 if pod.get('suspended') else 0}")
        print(f"pod_{pid}_workers={pod.get('workers', 0)}")
        pg = pod.get("gpus") or []
        placed = bool(pg) and pg[0].get("uuid") is not None and pg[0].get("ordinal") is not None
        print(f"pod_{pid}_placed={1 if placed else 0}")
        if pg:
            g = pg[0]
            for key in ("policy", "weight", "cap_percent", "share_percent", "rate_ppm", "ceiling_ppm",
                        "achieved_ppm", "waiting", "launches", "tokens_ns", "ordinal", "uuid"):
                print(f"pod_{pid}_{key}={g.get(key)}")
            print(f"pod_{pid}_active={1 if g.get('active') else 0}")
    workers = status.get("workers") or []
    print(f"workers_total={len(workers)}")
    print(f"worker_pods={','.join(sorted({w.get('pod', '?') for w in workers}))}")
    print(f"workers_adopted={sum(1 for w in workers if w.get('adopted'))}")
    adm = status.get("admission") or {}
    print(f"admission_count={adm.get('count')}")
    print(f"admission_timeouts={adm.get('timeouts')}")
    print("ok=1")


def cmd_admin(base, token, action, pod, at=None):
    if at is not None:
        delay = float(at) - time.time()
        if delay > 0:
            time.sleep(delay)
    t0 = time.time()
    code, body = request(f"{base}/api/v1/pods/{pod}/{action}", method="POST", token=token, timeout=5.0)
    t1 = time.time()
    print(f"sent_epoch={t0:.6f}")
    print(f"at_epoch={t1:.6f}")
    print(f"elapsed_ms={(t1 - t0) * 1000:.1f}")
    print(f"http_status={code}")
    print(f"answer={one_line(body)}")
    print(f"ok={1 if code == 200 else 0}")


def cmd_wait_workers(base, until, pods):
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
                print(f"seen_epoch={now:.6f}")
                print(f"polls={polls}")
                print(f"errors={errors}")
                print(f"workers_total={len(workers)}")
                print(f"workers_adopted={adopted}")
                print("ok=1")
                return
        if now >= until:
            break
        time.sleep(0.02)
    print(f"polls={polls}")
    print(f"errors={errors}")
    print(f"seen_pods={','.join(sorted(seen))}")
    print(f"workers_adopted={adopted}")
    print("ok=0")


UNIT_US = {"ns": 1e-3, "µs": 1.0, "μs": 1.0, "us": 1.0, "ms": 1e3, "s": 1e6}
DUR = r"([0-9]+(?:\.[0-9]+)?)(ns|µs|μs|us|ms|s)"


def us(value, unit):
    return float(value) * UNIT_US[unit]


def cmd_latency(log):
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        print(f"error=cannot read {log}: {e.strerror}")
        print("ok=0")
        return
    found = False
    for line in text.splitlines():
        if "admission latency" in line:
            m = re.search(r"p50 " + DUR + r", p99 " + DUR, line)
            if m and not found:
                found = True
                print(f"p50_us={us(m.group(1), m.group(2)):.1f}")
                print(f"p99_us={us(m.group(3), m.group(4)):.1f}")
            m = re.search(r"p99 [^,]*, max " + DUR, line)
            if m:
                print(f"max_us={us(m.group(1), m.group(2)):.1f}")
            m = re.search(r"/healthz p50 " + DUR + r", p99 " + DUR, line)
            if m:
                print(f"healthz_p50_us={us(m.group(1), m.group(2)):.1f}")
                print(f"healthz_p99_us={us(m.group(3), m.group(4)):.1f}")
            m = re.search(r"(unoptimized|optimized) build", line)
            if m:
                print(f"build={m.group(1)}")
        elif "concurrent clients" in line:
            m = re.search(r"p50 " + DUR + r", p99 " + DUR, line)
            if m:
                print(f"concurrent_p50_us={us(m.group(1), m.group(2)):.1f}")
                print(f"concurrent_p99_us={us(m.group(3), m.group(4)):.1f}")
    # "server side p50 ≤ 50 µs, p99 ≤ 100 µs" (older builds: "≤ Some(50) µs")
    m = re.search(r"server[- ]side[^\n]*?p50 ≤ (?:Some\()?(\d+)\)? ?[µμu]s, p99 ≤ (?:Some\()?(\d+)\)? ?[µμu]s", text)
    if m:
        print(f"server_p50_us={m.group(1)}")
        print(f"server_p99_us={m.group(2)}")
    m = re.search(r"test result: (\w+)\. (\d+) passed; (\d+) failed", text)
    if m:
        print(f"tests_passed={m.group(2)}")
        print(f"tests_failed={m.group(3)}")
    print(f"ok={1 if found else 0}")


def main(argv):
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    base, cmd, rest = argv[0].rstrip("/"), argv[1], argv[2:]
    try:
        if cmd == "wait-up" and len(rest) == 1:
            cmd_wait_up(base, rest[0])
        elif cmd == "status" and len(rest) <= 1:
            cmd_status(base, rest[0] if rest else None)
        elif cmd == "admin" and len(rest) in (3, 4):
            cmd_admin(base, *rest)
        elif cmd == "wait-workers" and len(rest) >= 2:
            cmd_wait_workers(base, rest[0], rest[1:])
        elif cmd == "latency" and len(rest) == 1:
            cmd_latency(rest[0])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except (ValueError, KeyError, TypeError) as e:
        print(f"error={one_line(e)}")
        print("ok=0")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
