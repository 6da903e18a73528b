"""The swap bench's parts, each with a daemon of its own: the pinned
bandwidth, swaps of each size, an inference pod's first request after a
swap, three pods overcommitting GPU 0, and a pod moved between GPUs; each
prints its figures as they come and returns them for the report."""
import json
import subprocess
import sys
import time

from scripts.gpu.e2e.harness import hv
from scripts.gpu.e2e.harness.parse import median as med

from . import common
from .swap_bench import (ADMIN, GIB, MIB, POD_ENV, POD_PROGRAM, BenchError, gib, gpu_memory, gpu_uuids, guarded,
                         host_available, smi_mib, smi_where)
from .swap_report import fmt, share, yes

QUOTA_MARGIN = 4 * GIB
INFER_QUOTA, INFER_WEIGHTS = 16 * GIB, 8 * GIB
OVERCOMMIT_IDLE_MS, OVERCOMMIT_PAUSE_S, OVERCOMMIT_MIN_RESIDENT_MS = 1000, 1.5, 2000
# What a torch process's context and workspaces take besides its tensors.
CONTEXT = 1 * GIB


def overcommit_plan(total, free, host_room):
    """(quota, hold) of each of three pods on a GPU of `total` bytes with
    `free` free, two of them in `host_room` of host memory at once (one
    swapped, one swapped out to make room for its return), each with its
    context (the daemon counts what a process holds); BenchError when two
    cannot share the GPU or three would not overcommit it."""
    quota = total // 2
    hold = min(int(0.45 * total), host_room // 2 - CONTEXT, (free - 3 * CONTEXT) // 2)
    hold -= hold % (256 * MIB)
    if hold <= 0 or 3 * hold <= free - 3 * CONTEXT:
        raise BenchError(f"no overcommit possible: {gib(free)} GiB free on the GPU, {gib(host_room)} GiB for"
                         f" swapped pods on the host: each pod could hold {gib(max(hold, 0))} GiB")
    return quota, hold


def part_bandwidth(b):
    nbytes = min(4 * GIB, host_available() // 4)
    nbytes -= nbytes % (2 * MIB)
    env = {**common.clean_env("PYTORCH_CUDA_ALLOC_CONF"), **POD_ENV}
    out = subprocess.run([sys.executable, str(POD_PROGRAM), "bandwidth", str(nbytes)], capture_output=True,
                         text=True, env=env, timeout=300)
    (b.out / "pod-bandwidth.log").write_text(out.stdout + out.stderr)
    replies = [json.loads(l[6:]) for l in out.stdout.splitlines() if l.startswith("REPLY ")]
    if out.returncode != 0 or not replies or not replies[0].get("ready"):
        raise BenchError(f"exit {out.returncode}: {(out.stderr.strip().splitlines() or [''])[-1][:300]}")
    r = replies[0]
    r.update(h2d_median=med(r["h2d"]), d2h_median=med(r["d2h"]))
    print(f"pinned bandwidth ({gib(nbytes)} GiB, {r['name']}): H2D {r['h2d_median']:.1f} GiB/s, D2H"
          f" {r['d2h_median']:.1f} GiB/s (raw H2D {[round(x, 1) for x in r['h2d']]},"
          f" D2H {[round(x, 1) for x in r['d2h']]})", flush=True)
    return r


def swap_round(b, p, pod, held, quota, before, r):
    """One swap-out and swap-in of the pod, and the checks after; the
    figures go into r as they come (a round that fails keeps those)."""
    r["smi_before_mib"], r["gpu_used_before_mib"] = smi_mib(p.p.pid)
    time.sleep(0.2)  # the daemon refuses a pod whose last CUDA call is this fresh
    out = b.swapped(pod, held)
    record = b.pod_swap(pod)
    # The rates count what moved: the process's device memory, as the daemon
    # reports it (the tensors, the context's and the allocator's cache).
    moved = record.get("bytes_on_host") or held
    r.update(out_s=out["seconds"], moved=moved, out_gibs=moved / GIB / out["seconds"],
             daemon_out_s=record.get("last_swap_out_s"), path=record.get("last_swap_out_path"))
    r["smi_swapped_mib"], r["gpu_used_swapped_mib"] = smi_mib(p.p.pid)
    back = b.swap(pod, "swap-in", held)
    if back["http"] != 200 or back.get("residency") != "resident":
        raise BenchError(f"swap-in of {pod}: HTTP {back['http']} {back.get('residency') or back.get('error')}")
    r.update(in_s=back["seconds"], in_gibs=moved / GIB / back["seconds"],
             daemon_in_s=b.pod_swap(pod).get("last_swap_in_s"))
    r["smi_after_mib"], r["gpu_used_after_mib"] = smi_mib(p.p.pid)
    check, _ = p.ask("check", 120)
    r["identical"] = all(check.get(k) == before[k] for k in ("data", "matmul", "matmul_sum"))
    more, _ = p.ask(f"alloc {quota - held - GIB}", 120)
    beyond, _ = p.ask(f"alloc {2 * GIB}", 120)
    p.ask("release", 120)
    r["quota_intact"] = more.get("alloc") == "ok" and beyond.get("alloc") == "oom"
    r["alloc"] = [more.get("alloc"), beyond.get("alloc")]


def swap_size(b, size, pinned):
    held = int(size * GIB)
    held -= held % (2 * MIB)
    pod, quota = f"swap-{size:g}g", held + QUOTA_MARGIN
    prepares = b.totals().get("host_prepares") or 0
    p = b.start_pod(pod, "hold", held)
    try:
        before = p.ready()
        print(f"swap {size:g} GiB: pod {pod} (pid {p.p.pid}, quota {gib(quota)} GiB) filled in"
              f" {before['fill_s']:.1f} s", flush=True)
        prepared = prepared_ahead(b, pod, held, prepares) if b.args.path == "fast" else None
        rounds = []
        for n in range(b.args.rounds):
            r = {}
            r.update(guarded(f"  swap {size:g} GiB round {n + 1}", swap_round, b, p, pod, held, quota, before, r)
                     or {})
            rounds.append(r)
            if "failed" in r:
                if b.stuck or b.pod_swap(pod).get("state", "resident") != "resident":
                    break
                continue
            print(f"  round {n + 1}: {gib(r['moved'])} GiB moved by the {r.get('path') or 'n/a'} path; out {r['out_s']:.2f} s ({r['out_gibs']:.2f} GiB/s,"
                  f" {fmt(share(r['out_gibs'], pinned.get('d2h_median')), '.0%')} of pinned D2H; daemon"
                  f" {fmt(r['daemon_out_s'])} s), in {r['in_s']:.2f} s ({r['in_gibs']:.2f} GiB/s,"
                  f" {fmt(share(r['in_gibs'], pinned.get('h2d_median')), '.0%')} of pinned H2D; daemon"
                  f" {fmt(r['daemon_in_s'])} s); nvidia-smi MiB {fmt(r['smi_before_mib'], 'd', 'absent')} /"
                  f" {fmt(r['smi_swapped_mib'], 'd', 'absent')} / {fmt(r['smi_after_mib'], 'd', 'absent')}"
                  f" (GPU used {r['gpu_used_before_mib']} / {r['gpu_used_swapped_mib']} /"
                  f" {r['gpu_used_after_mib']}); identical {yes(r['identical'])}; quota intact"
                  f" {yes(r['quota_intact'])} {r['alloc']}", flush=True)
    finally:
        b.stop_pod(p)
    done = [r for r in rounds if "failed" not in r]
    if not done:
        outs = [f"{r['out_s']:.2f}" for r in rounds if "out_s" in r]
        return {"held": held, "quota": quota, "rounds": rounds,
                "failed": (f"swap-out {', '.join(outs)} s; " if outs else "")
                + (rounds[0]["failed"] if rounds else "no round run")}
    summary = {k: med(r[k] for r in done) for k in (
        "moved", "out_s", "in_s", "out_gibs", "in_gibs", "daemon_out_s", "daemon_in_s", "smi_before_mib", "smi_swapped_mib",
        "smi_after_mib", "gpu_used_before_mib", "gpu_used_swapped_mib", "gpu_used_after_mib")}
    summary.update(identical=all(r["identical"] for r in done), quota_intact=all(r["quota_intact"] for r in done),
                   out_share=share(summary["out_gibs"], pinned.get("d2h_median")),
                   in_share=share(summary["in_gibs"], pinned.get("h2d_median")),
                   first_out_s=rounds[0].get("out_s"), prepared_s=prepared)
    print(f"  median of {len(done)}: out {summary['out_s']:.2f} s ({summary['out_gibs']:.2f} GiB/s),"
          f" in {summary['in_s']:.2f} s ({summary['in_gibs']:.2f} GiB/s)", flush=True)
    return {"held": held, "quota": quota, "rounds": rounds, "summary": summary}


def prepared_ahead(b, pod, held, prepares):
    """Seconds from the pod's fill until the daemon had its host copies
    prepared ([swap] prepare_ahead: once idle, on any GPU), so that its
    first swap-out only copies, as later ones do: a prepare more than the
    `prepares` counted before the pod started, done, and the copies the
    pod keeps cover what it holds. None when they were not within a
    minute and 2 s a GiB (the first swap-out then pins as it copies, and
    its time says so)."""
    start, limit = time.monotonic(), 60 + 2 * held / GIB
    while time.monotonic() - start < limit and not b.stuck:
        done = (b.totals().get("host_prepares") or 0) > prepares
        if done and (b.pod_swap(pod).get("host_kept_bytes") or 0) >= held:
            took = time.monotonic() - start
            print(f"  host copies prepared ahead while idle, {took:.1f} s after the fill", flush=True)
            return took
        time.sleep(0.2)
    print(f"  host copies not prepared within {limit:.0f} s: the first swap-out pins as it copies", flush=True)
    return None


def part_swap(b, pinned):
    b.begin("swap")
    total, _, free = gpu_memory()
    room = min(b.host_limit, host_available() - 8 * GIB)
    results, quotas = {}, {}
    for size in b.args.sizes:
        need = int(size * GIB)
        if need + QUOTA_MARGIN + CONTEXT > free or need > room:
            why = (f"{size:g} GiB + {gib(QUOTA_MARGIN)} GiB does not fit the GPU's {gib(free)} GiB free"
                   if need + QUOTA_MARGIN + CONTEXT > free else f"host room for swapped pods {gib(room)} GiB")
            print(f"swap {size:g} GiB: FAILED: not run: {why}", flush=True)
            results[f"{size:g}"] = {"failed": f"not run: {why}"}
            continue
        quotas[f"swap-{size:g}g"] = need - need % (2 * MIB) + QUOTA_MARGIN
    if quotas:
        # On the fast path the daemon prepares an idle pod's host copies
        # (within the host room): every swap-out then only copies.
        extra = {"prepare_ahead": b.host_limit} if b.args.path == "fast" else None
        with b.serving("swap", quotas, extra=extra):
            for size in b.args.sizes:
                if f"swap-{size:g}g" not in quotas:
                    continue
                if b.stuck or b.left() < 30:
                    why = f"not run: {b.stuck or 'the run time (--budget-s) is spent'}"
                    print(f"swap {size:g} GiB: FAILED: {why}", flush=True)
                    results[f"{size:g}"] = {"failed": why}
                    continue
                results[f"{size:g}"] = guarded(f"swap {size:g} GiB", swap_size, b, size, pinned)
            results["totals"], results["metrics"] = b.totals(), b.metrics()
    return results


def part_infer(b):
    b.begin("infer")
    pod = "swap-infer"
    with b.serving("infer", {pod: INFER_QUOTA}):
        p = b.start_pod(pod, "infer", INFER_WEIGHTS)
        ready = p.ready()
        print(f"infer: pod {pod} (pid {p.p.pid}), {ready['layers']} layers of 4096x4096 fp16"
              f" ({gib(ready['weight_bytes'])} GiB), loaded in {ready['load_s']:.1f} s", flush=True)
        resident, swapped = [], []
        for _ in range(b.args.infer_rounds):
            time.sleep(b.args.idle_s)
            answer, took = p.ask("infer", 60)
            resident.append({"bench_s": took, "pod_s": answer.get("s"), "digest": answer.get("digest")})
        for n in range(b.args.infer_rounds):
            time.sleep(1.0)
            r = {}
            try:
                r["out_s"] = b.swapped(pod, INFER_QUOTA)["seconds"]
                answer, took = p.ask("infer", b.timeout(INFER_QUOTA))
                record = b.pod_swap(pod)
                r.update(bench_s=took, pod_s=answer.get("s"), digest=answer.get("digest"),
                         state=record.get("state"), daemon_in_s=record.get("last_swap_in_s"),
                         swap_ins=record.get("swap_ins"))
            except BenchError as e:
                print(f"  swapped request {n + 1}: FAILED: {e}", flush=True)
                r["failed"] = str(e)
            swapped.append(r)
            if "failed" in r and (b.stuck or p.p.poll() is not None or "no answer" in r["failed"]):
                break
        totals = b.totals()
    ok = [r for r in swapped if "failed" not in r]
    result = {
        "ready": ready, "resident": resident, "swapped": swapped, "totals": totals,
        "t0_s": med(r["bench_s"] for r in resident), "t1_s": med(r["bench_s"] for r in ok),
        "t1_pod_s": med(r["pod_s"] for r in ok), "swapped_ok": len(ok),
        "identical": all(r["digest"] == ready["digest"] for r in resident + ok),
    }
    if not ok:
        result["failed"] = f"no swapped request: {swapped[0].get('failed') if swapped else 'none run'}"
    print(f"infer: T0 (resident, after {b.args.idle_s:g} s idle) median {fmt(result['t0_s'], '.4f')} s, raw"
          f" {[round(r['bench_s'], 4) for r in resident]}; T1 (swapped) median {fmt(result['t1_s'])} s"
          f" (pod's own {fmt(result['t1_pod_s'])} s), raw {[round(r['bench_s'], 2) for r in ok]}"
          f" (pod's own {[round(r['pod_s'], 2) for r in ok]}), daemon swap-in"
          f" {[fmt(r['daemon_in_s']) for r in ok]} s, swap-out {[round(r['out_s'], 2) for r in ok]} s;"
          f" outputs identical {yes(result['identical'])}", flush=True)
    return result


def overcommit_given(total, free, host_room, pods, size_gib):
    """(quota, hold) of `pods` pods holding `size_gib` GiB each (--overcommit),
    each quota 4 GiB more (a request's work allocates 1 GiB beside the
    context, as in the swap part); BenchError when they would not overcommit the
    GPU, one would not fit it, or two would not fit `host_room`."""
    hold = int(size_gib * GIB)
    hold -= hold % (2 * MIB)
    quota = hold + 4 * GIB
    if pods * (hold + CONTEXT) <= free or hold + CONTEXT > free or 2 * (hold + CONTEXT) > host_room:
        raise BenchError(f"{pods} pods of {size_gib:g} GiB: {gib(free)} GiB free on the GPU, {gib(host_room)} GiB"
                         " for swapped pods on the host; they must overcommit the GPU, and two fit the host")
    return quota, hold


def part_overcommit(b):
    b.begin("overcommit")
    total, _, free = gpu_memory()
    room = min(b.host_limit, host_available() - 16 * GIB)
    given = b.args.overcommit
    count = given[0] if given else 3
    quota, hold = overcommit_given(total, free, room, *given) if given else overcommit_plan(total, free, room)
    pods = [f"swap-oc{n}" for n in range(1, count + 1)]
    print(f"overcommit: GPU 0 {gib(total)} GiB ({gib(free)} GiB free); {count} pods, quota {gib(quota)} GiB each"
          f" (sum {gib(count * quota)} GiB), each holding {gib(hold)} GiB once it works; idle_after"
          f" {OVERCOMMIT_IDLE_MS} ms, min_resident {OVERCOMMIT_MIN_RESIDENT_MS} ms, {OVERCOMMIT_PAUSE_S:g} s between"
          " requests", flush=True)
    turns, totals = [], {}
    # Two pods' host copies pinned ahead, so that the swap-out a request
    # waits for only copies; a pod brought back stays at least until the
    # next request (one in turn every 2 to 3 s), as in the serving bench,
    # after which its kept copies make it the cheapest to swap out.
    prepare = {"prepare_ahead": f'"{2 * hold // MIB}m"', "min_resident_ms": str(OVERCOMMIT_MIN_RESIDENT_MS)}
    with b.serving("overcommit", {pod: quota for pod in pods}, OVERCOMMIT_IDLE_MS, extra=prepare):
        procs = [b.start_pod(pod, "work", hold, 100 + n) for n, pod in enumerate(pods)]
        for p in procs:
            p.ready()
        for n in [*range(count), *range(count)]:
            time.sleep(OVERCOMMIT_PAUSE_S)
            before = b.totals()
            try:
                # A swap-out of another pod and this one's swap-in, at most.
                answer, took = procs[n].ask("work", b.timeout(hold, per_gib=8.0))
            except BenchError as e:
                answer, took = {"ok": False, "error": str(e)}, None
                b.stuck = b.stuck or str(e)
            after = b.totals()
            totals = after or totals
            turn = {"pod": pods[n], "bench_s": took, **answer,
                    **{k: after[k] - before[k] if before and after else None for k in ("swap_outs", "swap_ins")}}
            turns.append(turn)
            print(f"  {pods[n]}: {'ok' if answer.get('ok') else 'FAILED ' + str(answer.get('error'))}"
                  f" in {fmt(took)} s (pod's own {fmt(answer.get('s'))} s), the daemon swapped"
                  f" {fmt(turn['swap_outs'], 'd', '?')} out and {fmt(turn['swap_ins'], 'd', '?')} in", flush=True)
            if took is None:
                break
        totals, metrics = b.totals() or totals, b.metrics()
    digests = {}
    for t in turns:
        if t.get("ok"):
            digests.setdefault(t["pod"], set()).add((t.get("data"), t.get("matmul")))
    why = [w for w, bad in (("out of memory", any(t.get("oom") for t in turns)),
                            ("a request failed", not all(t.get("ok") for t in turns)),
                            ("digests changed", any(len(d) > 1 for d in digests.values())),
                            ("no swap happened", not b.stuck and not totals.get("swap_outs"))) if bad]
    ok = not why
    print(f"overcommit: {'PASS' if ok else 'FAIL ' + ', '.join(why)}; daemon totals {totals}", flush=True)
    return {"total": total, "free": free, "pods": count, "quota": quota, "hold": hold, "turns": turns,
            "totals": totals, "metrics": metrics, "pass": ok, "why": why}


def move_step(b, p, pod, held, quota, before, gpus, action, to):
    """One move of the pod (action: ("move", index) or ("drain", index of
    the GPU drained)) and the checks after; its figures."""
    kind, index = action
    url = (f"{b.daemon.url}/api/v1/pods/{pod}/move" if kind == "move"
           else f"{b.daemon.url}/api/v1/gpus/{index}/drain")
    time.sleep(0.2)
    start = time.monotonic()
    code, body = hv.hvctl.request(url, method="POST", token=ADMIN, timeout=b.timeout(held),
                                  body=json.dumps({"to": index}) if kind == "move" else None)
    took = time.monotonic() - start
    if code != 200:
        raise BenchError(f"{kind} {index}: HTTP {code} {body[:300]}")
    answer = json.loads(body)
    moved = answer if kind == "move" else (answer.get("moved") or [{}])[0]
    where = smi_where(p.p.pid)
    device, _ = p.ask("device", 60)
    check, _ = p.ask("check", 120)
    more, _ = p.ask(f"alloc {quota - held - GIB}", 120)
    beyond, _ = p.ask(f"alloc {2 * GIB}", 120)
    p.ask("release", 120)
    r = {"action": f"{kind} {index}", "http_s": took, "daemon_s": moved.get("seconds"), "path": moved.get("path"),
         "bytes": moved.get("bytes"), "to": moved.get("to"), "smi": where, "device_uuid": device.get("uuid"),
         "identical": all(check.get(k) == before[k] for k in ("data", "matmul", "matmul_sum")),
         "alloc": [more.get("alloc"), beyond.get("alloc")]}
    r["quota_intact"] = r["alloc"] == ["ok", "oom"]
    r["on_target"] = [u for u, _ in where] == [gpus[to]] and r["device_uuid"] == gpus[to] and r["to"] == gpus[to]
    gibs = (r["bytes"] or 0) / GIB / took
    print(f"  {r['action']}: {took:.2f} s ({gibs:.2f} GiB/s of {gib(r['bytes'] or 0)} GiB; daemon"
          f" {fmt(r['daemon_s'])} s, by {r['path'] or 'n/a'}); nvidia-smi {where}; device 0 reports {r['device_uuid']}; on GPU {to}"
          f" {yes(r['on_target'])}; identical {yes(r['identical'])}; quota intact {yes(r['quota_intact'])}"
          f" {r['alloc']}", flush=True)
    return r


def part_move(b):
    gpus = gpu_uuids()
    if len(gpus) < 2:
        line = "not run (one GPU)"
        print(f"move: {line}", flush=True)
        return {"line": line}
    b.begin("move")
    held = 8 * GIB
    pod, quota = "swap-move", held + QUOTA_MARGIN
    steps = []
    # On the fast path the pod's processes move its memory themselves and
    # the driver's checkpoint takes their contexts; its host copies are
    # prepared while it is idle, as for a swap.
    fast = b.args.path == "fast"
    extra = {"prepare_ahead": b.host_limit} if fast else None
    with b.serving("move", {pod: quota}, extra=extra):
        prepares = b.totals().get("host_prepares") or 0
        p = b.start_pod(pod, "hold", held)
        before = p.ready()
        print(f"move: pod {pod} (pid {p.p.pid}, quota {gib(quota)} GiB, {gib(held)} GiB held) on GPU 0 of"
              f" {len(gpus)}; nvidia-smi {smi_where(p.p.pid)}", flush=True)
        if fast:
            prepared_ahead(b, pod, held, prepares)
        for action, to in ((("move", 1), 1), (("move", 0), 0), (("drain", 0), 1)):
            step = guarded(f"  {action[0]} {action[1]}", move_step, b, p, pod, held, quota, before, gpus, action, to)
            steps.append(step)
            if "failed" in step:
                break
        totals = b.totals()
    ok = len(steps) == 3 and all("failed" not in s and s["on_target"] and s["identical"] and s["quota_intact"]
                                 for s in steps)
    line = (f"{'PASS' if ok else 'FAIL'}: " + "; ".join(
        s.get("failed", f"{s['action']} {s['http_s']:.2f} s") for s in steps)
            + ("; on the other GPU, identical, quota intact" if ok else ""))
    print(f"move: {line}; daemon totals {totals}", flush=True)
    return {"steps": steps, "totals": totals, "pass": ok, "line": line}


def part_limit(b):
    """The largest pod the host takes, and one beyond it refused up front."""
    b.begin("limit")
    _, _, free = gpu_memory()
    available = host_available()
    fits = min(available - 8 * GIB, free - QUOTA_MARGIN - CONTEXT)
    beyond = available - 2 * GIB
    if beyond + CONTEXT > free:
        raise BenchError(f"not run: the GPU's {gib(free)} GiB free cannot hold a pod beyond the host's"
                         f" {gib(available)} GiB available")
    fits -= fits % (256 * MIB)
    beyond -= beyond % (256 * MIB)
    quotas = {"limit-fits": fits + QUOTA_MARGIN, "limit-beyond": beyond + QUOTA_MARGIN}
    result = {"available": available, "free": free}
    with b.serving("limit", quotas, host_limit=available + 64 * GIB):
        p = b.start_pod("limit-fits", "hold", fits)
        try:
            before = p.ready()
            time.sleep(0.2)
            out = b.swap("limit-fits", "swap-out", fits)
            moved = b.pod_swap("limit-fits").get("bytes_on_host")
            back = b.swap("limit-fits", "swap-in", fits)
            check, _ = p.ask("check", 300)
            result["fits"] = {"held": fits, "out": out, "moved": moved, "in": back,
                              "identical": check.get("data") == before["data"]}
            print(f"limit: a pod holding {gib(fits)} GiB (host {gib(available)} GiB available): swap-out HTTP"
                  f" {out['http']} {out['seconds']:.1f} s ({gib(moved or 0)} GiB moved), swap-in HTTP {back['http']}"
                  f" {back['seconds']:.1f} s, identical {yes(result['fits']['identical'])}", flush=True)
        finally:
            b.stop_pod(p)
        p = b.start_pod("limit-beyond", "hold", beyond)
        try:
            p.ready()
            time.sleep(0.2)
            out = b.swap("limit-beyond", "swap-out", beyond)
            check, _ = p.ask("check", 300)
            result["beyond"] = {"held": beyond, "out": out, "runs_on": "data" in check,
                                "state": b.pod_swap("limit-beyond").get("state", "resident")}
            print(f"limit: a pod holding {gib(beyond)} GiB: swap-out HTTP {out['http']} in {out['seconds']:.2f} s:"
                  f" {out.get('error') or out.get('residency')}; it runs on: {yes(result['beyond']['runs_on'])}",
                  flush=True)
        finally:
            b.stop_pod(p)
    return result
