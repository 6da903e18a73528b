"""Checks 16-20: the node daemon (gpu-bundle/hypervisor, or E2E_HYPERVISOR)
drives the limiter. It serves on 127.0.0.1 and a port the harness picks, with
a config written to <work>/hv-<check>.toml; the spin processes run with
CUDA_LIMITER_HYPERVISOR, CUDA_LIMITER_POD and CUDA_LIMITER_TOKEN (no local
limit). Shares are each process's own busy time (the union of its kernel
intervals), from scripts/gpu/hv_intervals.py; t = seconds after the go file
released the processes."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import pytest
from harness.checks import AtLeast, AtMost, Tolerance, Why, num, pct_from_ppm, q
from harness.hv import Daemon, HvError, Timeline, pod_section, registered, write_config
from harness.proc import Proc, clean_shm, gpu_count, run, wait_ready

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hv_intervals
import hvctl

SHARE = Tolerance(pp=3)
OUTAGE = Tolerance(pp=5)  # check 19: the busy share while the daemon is down
ALONE = AtLeast(90)  # 17b: an elastic pod alone
SUSPENDED = AtMost(3)  # 18: busy while suspended
REREGISTERED_BY_S = AtMost(5.5)  # 19
P50_US, P99_US = AtMost(200), AtMost(2000)  # 20
ADMIN = f"e2e-admin-{os.getpid()}-{random.randrange(1 << 30)}"


def prereq(check) -> str:
    s = check.s
    why = []
    if not s.hypervisor:
        why.append("no hypervisor binary")
    if not s.built("spin"):
        why.append("spin not built")
    if not os.path.isfile(s.lib):
        why.append(f"no {s.lib}")
    return "; ".join(why)


def daemon(check, tag: str, *sections: str) -> Daemon:
    cfg = write_config(check.s.work / f"hv-{tag}.toml", ADMIN, *sections)
    clean_shm()
    return Daemon(check.s, tag, cfg, check.say)


def start(check, d: Daemon) -> str:
    """Starts the daemon; the reason when it did not start, else ""."""
    try:
        d.start()
    except (HvError, OSError) as e:
        check.say(f"   {e} (log {d.log})")
        return str(e)
    check.s.hv_url = d.url
    return ""


def hv_spin(check, tag: str, pod: str, secs, go: Path, gpu: int = 0) -> Proc:
    """spin runtime 2000 us for secs under the daemon, released by go, on
    GPU index gpu (the only one the process sees)."""
    log, dump = check.log / f"{tag}.log", check.s.work / f"{tag}.intervals"
    dump.unlink(missing_ok=True)
    p = Proc(check.s, "hv", pod, log, int(float(secs)) + 60,
             [check.s.bin("spin"), "runtime", "2000", str(secs), str(dump), str(go)])
    if gpu:
        p.env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    return p.start()


def analyse(check, tag: str, files, **opts) -> dict:
    """hv_intervals.analyse into <tag>-analysis.log; {"error": ...} when it fails."""
    files = [str(check.s.work / f) for f in files]
    try:
        r = hv_intervals.analyse(files, **opts)
    except hv_intervals.AnalysisError as e:
        r = {"error": str(e)}
    (check.log / f"{tag}-analysis.log").write_text(f"# {opts} {files}\n" + "".join(f"{k}={v}\n" for k, v in r.items()))
    return r


@pytest.mark.check("16")
def test_weighted(check):
    """16: pods A, B weights 1:3, policy fixed, no cap, 4 s at once: A = 25 +- 3,
    B = 75 +- 3 pp (from 1 s, common span; spin union). On the machine's last
    GPU: GPU 1 of two, where the daemon's per-GPU sharing shows past index 0."""
    a, b, gpu = "e2e-c16-a", "e2e-c16-b", gpu_count() - 1
    row = check.row(f"16. hypervisor weighted sharing on GPU {gpu}: pods A (weight 1) and B (weight 3), policy fixed, "
                    "no cap; spin 2000us runtime 4 s each, at once: own busy share from 1 s (common span)",
                    "A=25+-3%, B=75+-3%")
    if prereq(check):
        return row.fail(prereq(check))
    d = daemon(check, "16", pod_section(a, "weight = 1", 'policy = "fixed"', gpu=gpu),
               pod_section(b, "weight = 3", 'policy = "fixed"', gpu=gpu))
    go, tl, why = check.s.work / "go-16", Timeline(), Why()
    go.unlink(missing_ok=True)
    try:
        if (err := start(check, d)):
            return row.fail(err)
        why.add(*d.placed("16-start", a, b))
        pa, pb = hv_spin(check, "16-A", a, 4, go, gpu), hv_spin(check, "16-B", b, 4, go, gpu)
        why.need(wait_ready([pa, pb], 40), "not-ready")
        tl.go(go)
        tl.sleep_until(2.5)
        st = d.status("16-mid")
        pa.wait(), pb.wait()
    finally:
        d.stop()
        clean_shm()
    u = run(check.s, "base", "-", check.log / "16-union.log", 60,
            [check.s.bin("spin"), "union", str(check.s.work / "16-A.intervals"), str(check.s.work / "16-B.intervals")])
    an = analyse(check, "16", ["16-A.intervals", "16-B.intervals"], origin="common", wins=["after1s:start+1:end"],
                 series=["all:start:end"])
    sa, sb, su = u.kv("file0_share_after1s_pct"), u.kv("file1_share_after1s_pct"), u.kv("share_after1s_pct")
    ra, rb = pct_from_ppm(st.get(f"pod_{a}_rate_ppm")), pct_from_ppm(st.get(f"pod_{b}_rate_ppm"))
    why.add(*registered(st, a, b))
    check.say(f"   16: at t=2.5 s: workers A={q(st.get(f'pod_{a}_workers'))} B={q(st.get(f'pod_{b}_workers'))}, "
              f"admissions {q(st.get('admission_count'))} ({q(st.get('admission_timeouts'))} timed out)")
    check.say(f"   16: A 100 ms series (per-mille): {q(an.get('series_all_f0_pm'))}")
    check.say(f"   16: B 100 ms series (per-mille): {q(an.get('series_all_f1_pm'))}")
    why.add(pa.spin_why("A"), pb.spin_why("B"))
    why.need(u.kv("ok") == "1", "union-failed")
    why.need(SHARE.around(25).holds(sa), "A-off-by>3pp")
    why.need(SHARE.around(75).holds(sb), "B-off-by>3pp")
    row.done("-", f"A={q(sa)}% B={q(sb)}% (union {q(su)}%, overlap {q(an.get('win_after1s_overlap_pct'))}%; "
                  f"granted at t=2.5 s A={ra}% B={rb}%)", why)


@pytest.mark.check("17")
def test_cap(check):
    """17a: pod A cap 30, policy fixed, alone: 30 +- 3 pp."""
    a = "e2e-c17a-a"
    row = check.row("17a. hypervisor cap: pod A cap = 30, policy fixed, alone; spin 2000us runtime 3 s: "
                    "busy share from 1 s", "A=30+-3%")
    if prereq(check):
        return row.fail(prereq(check))
    d = daemon(check, "17a", pod_section(a, "cap = 30", 'policy = "fixed"'))
    go, tl, why = check.s.work / "go-17a", Timeline(), Why()
    go.unlink(missing_ok=True)
    try:
        if (err := start(check, d)):
            return row.fail(err)
        why.add(*d.placed("17a-start", a))
        p = hv_spin(check, "17a-A", a, 3, go)
        why.need(wait_ready([p], 40), "not-ready")
        tl.go(go)
        tl.sleep_until(2)
        st = d.status("17a-mid")
        p.wait()
    finally:
        d.stop()
        clean_shm()
    s = p.kv("share_after1s_pct")
    check.say(f"   17a: A 100 ms series (per-mille): {q(p.kv('windows100_pm'))}")
    why.add(p.spin_why("A"))
    why.add(*registered(st, a))
    why.need(SHARE.around(30).holds(s), "A-off-by>3pp")
    row.done("-", f"A={q(s)}% (settle {q(p.kv('settle_ms'))} ms, first 1 s {q(p.kv('share_first1s_pct'))}%; "
                  f"granted {pct_from_ppm(st.get(f'pod_{a}_rate_ppm'))}%)", why)


@pytest.mark.check("17")
def test_elastic(check):
    """17b: pod A share 30, elastic, alone 2 s (>= 90% over [0.5, 2] s), then pod
    B for 3 s: A over [B start + 1 s, B end] = max(30, weighted fair) +- 3 pp."""
    w = check.s.hv_b_weight
    fair = f"{100 / (1 + w):.1f}"
    target = f"{max(float(fair), 30):.1f}"
    row = check.row(f"17b. hypervisor elastic: pod A share = 30, policy elastic, weight 1, alone 2 s; then pod B "
                    f"(weight {w}, policy fixed, no cap) for 3 s. A's contended share = max(guaranteed 30, weighted "
                    f"fair {fair}) = {target}% (water-filling: floors first, then weights)",
                    f"A alone [0.5 s, 2 s] >= 90%; A over [B start + 1 s, B end] = {target}+-3%")
    if prereq(check):
        return row.fail(prereq(check))
    a, b = "e2e-c17b-a", "e2e-c17b-b"
    d = daemon(check, "17b", pod_section(a, "weight = 1", "share = 30", 'policy = "elastic"'),
               pod_section(b, f"weight = {w}", 'policy = "fixed"'))
    goa, gob, tl, why = check.s.work / "go-17b-A", check.s.work / "go-17b-B", Timeline(), Why()
    goa.unlink(missing_ok=True), gob.unlink(missing_ok=True)
    try:
        if (err := start(check, d)):
            return row.fail(err)
        why.add(*d.placed("17b-start", a, b))
        pa, pb = hv_spin(check, "17b-A", a, 5.3, goa), hv_spin(check, "17b-B", b, 3, gob)
        why.need(wait_ready([pa, pb], 40), "not-ready")
        tl.go(goa)
        tl.sleep_until(1.5)
        st1 = d.status("17b-alone")
        tl.sleep_until(2.0)
        gob.touch()
        tb = tl.now()
        tl.sleep_until(3.5)
        st2 = d.status("17b-contended")
        pa.wait(), pb.wait()
    finally:
        d.stop()
        clean_shm()
    an = analyse(check, "17b", ["17b-A.intervals", "17b-B.intervals"], origin="f0",
                 wins=["alone:0.5:2.0", "contended:s1+1:end"], series=["around:s1-0.5:s1+1.5"],
                 settles=[f"ret:0:s1:end:{target}:3"])
    alone, cont, bcont = an.get("win_alone_f0_pct"), an.get("win_contended_f0_pct"), an.get("win_contended_f1_pct")
    ret, rets = an.get("settle_ret_ms"), an.get("settle_ret_sliding_ms")
    check.say(f"   17b: B released at t={tb} s, B's first kernel {q(an.get('f1_first_s'))} s after A's first")
    check.say(f"   17b: 100 ms series from B start - 0.5 s (per-mille), A: {q(an.get('series_around_f0_pm'))}")
    check.say(f"   17b:                                              B: {q(an.get('series_around_f1_pm'))}")
    check.say(f"   17b: A back within {target}+-3pp: {q(ret)} ms after B's start (100 ms windows; 500 ms sliding "
              f"average: {q(rets)} ms; -1 = never)")
    why.add(pa.spin_why("A"), pb.spin_why("B"))
    why.add(*registered(st2, a, b))
    why.need(an.get("ok") == "1", "analysis-failed")
    why.need(ALONE.holds(alone), "A-alone<90%")
    why.need(SHARE.around(float(target)).holds(cont), "A-contended-off-by>3pp")
    row.done("-", f"A alone={q(alone)}%; contended A={q(cont)}% B={q(bcont)}%; A back in {q(ret)} ms (sliding "
                  f"{q(rets)} ms); granted A alone={pct_from_ppm(st1.get(f'pod_{a}_rate_ppm'))}%, contended "
                  f"A={pct_from_ppm(st2.get(f'pod_{a}_rate_ppm'))}% B={pct_from_ppm(st2.get(f'pod_{b}_rate_ppm'))}%", why)


@pytest.mark.check("18")
def test_suspend_resume(check):
    """18: pod A cap 50 suspended at t=1.5 s and resumed at t=3.5 s through the
    admin API: busy in [1.7, 3.4] s <= 3%, from 3.7 s 50 +- 3 pp, exit 0,
    kernels = launches."""
    a = "e2e-c18-a"
    row = check.row("18. hypervisor suspend/resume: pod A cap = 50, policy fixed, alone, spin 2000us runtime 5 s; "
                    "suspend at t=1.5 s, resume at t=3.5 s",
                    "busy [1.7 s, 3.4 s] <= 3%; from 3.7 s 50+-3%; exit 0, kernels = launches")
    if prereq(check):
        return row.fail(prereq(check))
    d = daemon(check, "18", pod_section(a, "cap = 50", 'policy = "fixed"'))
    go, tl, why = check.s.work / "go-18", Timeline(), Why()
    go.unlink(missing_ok=True)
    try:
        if (err := start(check, d)):
            return row.fail(err)
        why.add(*d.placed("18-start", a))
        p = hv_spin(check, "18-A", a, 5, go)
        why.need(wait_ready([p], 40), "not-ready")
        tl.go(go)
        ls = d.admin(ADMIN, "suspend", a, tl.abs(1.5), "18-suspend")  # sent at exactly t=1.5 s
        tl.sleep_until(2.5)
        st = d.status("18-suspended")
        lr = d.admin(ADMIN, "resume", a, tl.abs(3.5), "18-resume")
        tl.sleep_until(4.3)
        d.status("18-resumed")
        p.wait()
    finally:
        d.stop()
        clean_shm()
    an = analyse(check, "18", ["18-A.intervals"], origin="f0", ref_epoch=tl.t_go,
                 wins=["before:1.0:1.5", "suspended:1.7:3.4", "after:3.7:e0"], series=["all:0:e0"],
                 gaps=["off:0:0.5:e0"])
    ts, tr = tl.since(ls.get("at_epoch")), tl.since(lr.get("at_epoch"))
    bb, bs, ba = an.get("win_before_f0_pct"), an.get("win_suspended_f0_pct"), an.get("win_after_f0_pct")
    gs, ge = an.get("gap_off_start_s"), an.get("gap_off_end_s")
    kn, ln = p.kv("kernels"), p.kv("launches")
    check.say(f"   18: suspend sent at t={tl.since(ls.get('sent_epoch'))} s, answered at t={ts} s "
              f"(HTTP {q(ls.get('http_status'))}: {q(ls.get('answer'))})")
    check.say(f"   18: resume sent at t={tl.since(lr.get('sent_epoch'))} s, answered at t={tr} s "
              f"(HTTP {q(lr.get('http_status'))}: {q(lr.get('answer'))})")
    check.say(f"   18: longest idle stretch {q(gs)}..{q(ge)} s; first kernel {q(an.get('origin_minus_ref_ms'))} ms "
              "after go (if %globaltimer follows the host clock)")
    check.say(f"   18: 100 ms series (per-mille): {q(an.get('series_all_f0_pm'))}")
    check.say(f"   18: launch stalls: max {q(p.kv('max_stall_us'))} us, {q(p.kv('stalls_over_1ms'))} over 1 ms")
    why.add(p.spin_why("A"))
    why.add(*registered(st, a))
    why.need(ls.get("ok") == "1", f"suspend-HTTP-{q(ls.get('http_status'))}")
    why.need(lr.get("ok") == "1", f"resume-HTTP-{q(lr.get('http_status'))}")
    why.need(st.get(f"pod_{a}_suspended") == "1", "status-not-suspended")
    why.need(an.get("ok") == "1", "analysis-failed")
    why.need(SUSPENDED.holds(bs), "busy-while-suspended>3%")
    why.need(SHARE.around(50).holds(ba), "after-resume-off-by>3pp")
    why.need(num(kn) is not None and kn == ln, "kernels!=launches")
    row.done("-", f"before={q(bb)}% suspended={q(bs)}% after={q(ba)}%; idle {q(gs)}..{q(ge)} s; calls at "
                  f"t={ts}/{tr} s; kernels={q(kn)} launches={q(ln)}", why)


@pytest.mark.check("19")
def test_daemon_restart(check):
    """19: pods A, B weights 1:1, kill -9 of the daemon at t=2 s, started again at
    t=4 s on the same port: both exit 0, busy in [2.2, 3.8] s = last granted
    share +- 5 pp, workers of both pods listed again by t=5.5 s."""
    a, b = "e2e-c19-a", "e2e-c19-b"
    row = check.row("19. hypervisor kill -9 at t=2 s, restart at t=4 s: pods A and B (weight 1 each, policy fixed), "
                    "spin 2000us runtime 6 s each",
                    "both exit 0; each pod's busy in [2.2 s, 3.8 s] = its last granted share +-5pp; workers of both "
                    "pods listed again by t=5.5 s")
    if prereq(check):
        return row.fail(prereq(check))
    d = daemon(check, "19", pod_section(a, "weight = 1", 'policy = "fixed"'),
               pod_section(b, "weight = 1", 'policy = "fixed"'))
    go, tl, why = check.s.work / "go-19", Timeline(), Why()
    go.unlink(missing_ok=True)
    tu = tw = "?"
    lw: dict = {}
    try:
        if (err := start(check, d)):
            return row.fail(err)
        why.add(*d.placed("19-start", a, b))
        pa, pb = hv_spin(check, "19-A", a, 6, go), hv_spin(check, "19-B", b, 6, go)
        why.need(wait_ready([pa, pb], 40), "not-ready")
        tl.go(go)
        tl.sleep_until(1.8)
        st = d.status("19-prekill")
        tl.sleep_until(2.0)
        d.kill9()
        tk = tl.now()
        d.note(f"killed with SIGKILL at t={tk} s")
        tl.sleep_until(4.0)
        try:
            d.start(port=d.port)
            tu = tl.now()
            lw = d.wait_workers(tl.abs(6.5), [a, b], "19-workers")
            tw = tl.since(lw.get("seen_epoch"))
            d.status("19-restarted")
        except (HvError, OSError) as e:
            check.say(f"   {e}")
            why.add("restart-failed")
        pa.wait(), pb.wait()
    finally:
        d.stop()
        clean_shm()
    an = analyse(check, "19", ["19-A.intervals", "19-B.intervals"], origin="first",
                 wins=["pre:1.0:2.0", "outage:2.2:3.8", "post:4.5:end"], series=["all:0:end"])
    ga, gb = pct_from_ppm(st.get(f"pod_{a}_rate_ppm")), pct_from_ppm(st.get(f"pod_{b}_rate_ppm"))
    oa, ob = an.get("win_outage_f0_pct"), an.get("win_outage_f1_pct")
    check.say(f"   19: killed at t={tk} s, status answering again at t={tu} s, workers of both pods listed at "
              f"t={tw} s ({q(lw.get('workers_adopted'))} adopted)")
    check.say(f"   19: A 100 ms series (per-mille): {q(an.get('series_all_f0_pm'))}")
    check.say(f"   19: B 100 ms series (per-mille): {q(an.get('series_all_f1_pm'))}")
    check.say(f"   19: launch stalls: A max {q(pa.kv('max_stall_us'))} us, B max {q(pb.kv('max_stall_us'))} us")
    why.add(pa.spin_why("A"), pb.spin_why("B"))
    why.add(*registered(st, a, b))
    why.need(an.get("ok") == "1", "analysis-failed")
    if ga == "?" or gb == "?":
        why.add("no-granted-share-before-the-kill")
    else:
        why.need(OUTAGE.around(float(ga)).holds(oa), "A-outage-off-by>5pp")
        why.need(OUTAGE.around(float(gb)).holds(ob), "B-outage-off-by>5pp")
    why.need(lw.get("ok") == "1", "workers-not-listed-again")
    why.need(REREGISTERED_BY_S.holds(tw), "re-registration-after-5.5s")
    row.done("-", f"granted A={ga}% B={gb}%; outage A={q(oa)}% B={q(ob)}% (before A={q(an.get('win_pre_f0_pct'))}% "
                  f"B={q(an.get('win_pre_f1_pct'))}%, after restart A={q(an.get('win_post_f0_pct'))}% "
                  f"B={q(an.get('win_post_f1_pct'))}%); workers back at t={tw} s", why)


@pytest.mark.check("20")
def test_admission_latency(check):
    """20: the hypervisor's admission-latency benchmark (benches/admission_latency.rs)
    on loopback, when the bundle has it: client-side p50 <= 200 us, p99 <= 2 ms."""
    row = check.row("20. hypervisor admission latency (benches/admission_latency.rs: 100 workers of 4 pods, loopback, client side)",
                    "p50 <= 200us, p99 <= 2ms")
    if not check.s.latency_test:
        return row.done("-", "no hypervisor-admission-latency in the bundle", Why(), info=True)
    p = run(check.s, "base", "-", check.log / "20-latency.log", 300,
            [check.s.latency_test], cwd=str(check.s.work))
    clean_shm()
    r = hvctl.cmd_latency(str(p.log))
    (check.log / "20-latency-parsed.log").write_text(r.text())
    g = r.get
    why = Why()
    why.need(p.rc == 0, f"test-exit={p.rc}")
    why.need(g("ok") == "1", "no-latency-line")
    why.need(P50_US.holds(g("p50_us")), "p50>200us")
    why.need(P99_US.holds(g("p99_us")), "p99>2ms")
    row.done("-", f"p50={q(g('p50_us'))}us p99={q(g('p99_us'))}us max={q(g('max_us'))}us; server side "
                  f"p50<={q(g('server_p50_us'))}us p99<={q(g('server_p99_us'))}us; GET /healthz "
                  f"p50={q(g('healthz_p50_us'))}us; 4 concurrent clients p99={q(g('concurrent_p99_us'))}us; "
                  f"{q(g('build'))} build", why)
