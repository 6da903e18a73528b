//! The probe's `spin`, `run`, `series`, `pace`, `settled` and `maxstall` report the
//! double's simulated GPU clock, through every launch API and whichever way
//! they reach the driver.
//!
//! Busy time is exact (it is booked, not measured). What depends on when the
//! probe's thread ran (a share, an idle window, a stall) is bounded with the
//! time that thread waited for a CPU, which the probe reports (`delay_ns`):
//! on a loaded machine a launch can only come late, never early.
#![cfg(all(target_arch = "x86_64", target_os = "linux"))]

use crate::common;

use common::{MS, VARIANTS, assert_malformed, lines};
use gpushare_examples::{BUSY_SYMBOL, probe_field};

/// Every launch API of `spin`, `run` and `pace` that takes its duration from
/// the kernel parameter.
const TIMED_APIS: &[&str] = &[
    "kernel",
    "kernel_ptsz",
    "ex",
    "ex_ptsz",
    "coop",
    "coop_ptsz",
    "graph",
    "graph_ptsz",
];

/// The legacy launches, which last `GPUSHARE_DOUBLE_KERNEL_NS`.
const LEGACY_APIS: &[&str] = &["legacy", "grid", "grid_async"];

fn field(line: &str, key: &str) -> u64 {
    probe_field(line, key).unwrap_or_else(|| panic!("no {key}= in {line:?}"))
}

#[test]
fn spin_fills_the_gpu_through_every_launch_api() {
    for &(name, options) in VARIANTS {
        for api in TIMED_APIS {
            let script = format!("spin {api} 1000 20");
            let out = lines(name, options, &format!("{script} settled"), &[]);
            let context = format!("{name} {options:?}: {out:?}");
            let line = &out[0];
            assert!(
                line.starts_with(&format!("{script} -> 0 wall_ns=")),
                "{context}"
            );
            let (wall, busy) = (field(line, "wall_ns"), field(line, "busy_ns"));
            assert!(busy.abs_diff(20 * MS) <= 20 * MS / 100, "{context}");
            assert!(wall >= busy, "{context}");
            assert_eq!(field(line, "share_pm"), busy * 1000 / wall, "{context}");
            // Back to back, the GPU idles only until the last launch is in
            // (microseconds, unless the machine kept the thread off its
            // CPU): from the run's start to when the device finished, what
            // is not busy is at most that (0.5 ms of slack). How long the
            // synchronize then takes to wake is the machine's, not the run's.
            let settled = field(&out[1], "from_start_ns");
            let (launching, delay) = (field(line, "launching_ns"), field(line, "delay_ns"));
            assert!(settled - busy <= launching + delay + MS / 2, "{context}");
        }
    }
}

#[test]
fn legacy_launches_last_the_default_kernel_time() {
    for &(name, options) in VARIANTS {
        let script: String = LEGACY_APIS
            .iter()
            .map(|api| format!("spin {api} 1000 10 "))
            .collect();
        for (env, busy) in [
            (&[][..], 10 * 100_000),
            (&[("GPUSHARE_DOUBLE_KERNEL_NS", "500000")][..], 10 * 500_000),
        ] {
            let out = lines(name, options, &script, env);
            assert_eq!(out.len(), LEGACY_APIS.len());
            for (line, api) in out.iter().zip(LEGACY_APIS) {
                assert!(
                    line.starts_with(&format!("spin {api} 1000 10 -> 0 wall_ns=")),
                    "{name} {options:?}: {line}"
                );
                assert_eq!(field(line, "busy_ns"), busy, "{name} {options:?}: {line}");
            }
        }
    }
}

#[test]
fn run_series_pace_and_maxstall_report_the_clock() {
    // A short queue keeps the backlog after the 100 ms of launching short.
    let env = [("GPUSHARE_DOUBLE_QUEUE_DEPTH", "16")];
    for &(name, options) in VARIANTS {
        let out = lines(
            name,
            options,
            "run kernel 200 100 series 10 maxstall pace graph 1000 10 0 maxstall",
            &env,
        );
        let context = format!("{name} {options:?}: {out:#?}");
        assert_eq!(out.len(), 5, "{context}");

        assert!(
            out[0].starts_with("run kernel 200 100 -> 0 launches="),
            "{context}"
        );
        let launches = field(&out[0], "launches");
        let (wall, busy) = (field(&out[0], "wall_ns"), field(&out[0], "busy_ns"));
        // 100 ms of launching, then the 16 queued kernels drain.
        assert!(wall >= 100 * MS && launches >= 16, "{context}");
        assert!(launches * 200_000 <= wall + 200_000, "{context}");
        assert_eq!(busy, launches * 200_000, "{context}");
        assert_eq!(field(&out[0], "share_pm"), busy * 1000 / wall, "{context}");

        let windows = per_mille(&out[1], "series 10", &context);
        assert_eq!(windows.len() as u64, wall / (10 * MS), "{context}");
        assert!(windows.iter().all(|&pm| pm <= 1000), "{context}");
        // Full but for the time the thread waited for a CPU, which could all
        // fall in the median window (per mille of 10 ms: ns / 10,000).
        let mut sorted = windows.clone();
        sorted.sort_unstable();
        let window_delay = field(&out[0], "delay_ns") / 10_000;
        assert!(sorted[sorted.len() / 2] + window_delay >= 900, "{context}");

        // With the queue full, a launch waits for a kernel to finish.
        assert!(out[2].starts_with("maxstall ns="), "{context}");
        assert!(field(&out[2], "ns") >= 50_000, "{context}");

        // GPU-bound: 10 back-to-back 1 ms graphs.
        assert!(
            out[3].starts_with("pace graph 1000 10 0 -> 0 ns_per_iter="),
            "{context}"
        );
        assert!(field(&out[3], "ns_per_iter") >= MS, "{context}");
        assert!(out[4].starts_with("maxstall ns="), "{context}");
        assert!(
            field(&out[4], "ns") < 100 * MS + field(&out[3], "delay_ns"),
            "{context}"
        );
    }

    // Host-bound: 3 ms of host work per 100 µs kernel.
    let out = lines(
        "cudaprobe",
        &[],
        "pace kernel_ptsz 100 5 3000 series 5",
        &[],
    );
    assert!(
        out[0].starts_with("pace kernel_ptsz 100 5 3000 -> 0 ns_per_iter="),
        "{out:?}"
    );
    assert!(field(&out[0], "ns_per_iter") >= 3 * MS, "{out:?}");
    let windows = per_mille(&out[1], "series 5", &format!("{out:?}"));
    assert!(!windows.is_empty(), "{out:?}");
    assert!(windows.iter().all(|&pm| pm <= 100), "mostly idle: {out:?}");
}

#[test]
fn settled_is_when_the_device_finished_the_last_run() {
    for &(name, options) in VARIANTS {
        let out = lines(name, options, "clock spin kernel 1000 5 settled clock", &[]);
        let context = format!("{name} {options:?}: {out:#?}");
        assert_eq!(out.len(), 4, "{context}");
        assert!(out[2].starts_with("settled ns="), "{context}");
        let (before, settled, after) = (
            field(&out[0], "ns"),
            field(&out[2], "ns"),
            field(&out[3], "ns"),
        );
        // Five 1 ms kernels back to back, finished before the synchronize
        // returned.
        assert!(settled >= before + 5 * MS, "{context}");
        assert!(settled <= after, "{context}");
        assert!(
            settled + field(&out[1], "busy_ns") <= after + 5 * MS,
            "{context}"
        );
    }
}

#[test]
fn a_full_launch_queue_blocks_the_launch() {
    let out = lines(
        "cudaprobe",
        &[],
        "spin kernel 10000 4 maxstall",
        &[("GPUSHARE_DOUBLE_QUEUE_DEPTH", "2")],
    );
    assert_eq!(field(&out[0], "busy_ns"), 40 * MS, "{out:?}");
    // The third launch waits for the first kernel (10 ms).
    assert!(field(&out[1], "ns") >= 5 * MS, "{out:?}");
}

/// The per-mille windows of a `series` line that starts with `command`.
fn per_mille(line: &str, command: &str, context: &str) -> Vec<u64> {
    line.strip_prefix(command)
        .and_then(|rest| rest.strip_prefix(" pm="))
        .unwrap_or_else(|| panic!("not {command}: {context}"))
        .split(',')
        .map(|pm| {
            pm.parse()
                .unwrap_or_else(|_| panic!("bad window: {context}"))
        })
        .collect()
}

#[test]
fn periodic_requests_arrive_on_their_schedule() {
    let out = lines("cudaprobe", &[], "periodic 2 100 2000 5 series 2", &[]);
    let context = format!("{out:?}");
    assert!(
        out[0].starts_with("periodic 2 100 2000 5 -> 0 late_max_ns="),
        "{context}"
    );
    let arrivals: Vec<u64> = out[0]
        .split_once(" at=")
        .expect(&context)
        .1
        .split(',')
        .map(|at| at.parse().expect("arrival"))
        .collect();
    assert_eq!(arrivals.len(), 5, "{context}");
    let late_max: u64 = out[0]
        .split_once("late_max_ns=")
        .and_then(|(_, rest)| rest.split_whitespace().next()?.parse().ok())
        .expect(&context);
    // Due every 2 ms from the schedule's start, never early and never
    // later than `late_max`; the first request may itself be late by up to
    // that, so relative to it request i comes within `late_max` of i × 2 ms
    // either way (tight on an idle machine, wider when the probe was
    // descheduled).
    let first = arrivals[0];
    for (i, at) in arrivals.iter().enumerate() {
        let due = first + i as u64 * 2 * MS;
        assert!(
            *at + late_max >= due && *at <= due + late_max,
            "request {i}: {context}"
        );
    }
    // Each request keeps the GPU busy 200 µs of its 2 ms: ~100 per mille.
    // Requests due while the probe was descheduled come together once it
    // runs: one late by L shares its window with up to L / 2 ms more.
    let windows = per_mille(&out[1], "series 2", &context);
    assert!(windows.len() >= 3, "{context}");
    let bunched = late_max.div_ceil(2 * MS);
    assert!(
        windows.iter().all(|&pm| pm <= 200 + 100 * bunched),
        "{context}"
    );
    // On schedule, at least two requests' work falls in whole windows
    // (late ones can all land in the partial last window, which is left out).
    if late_max < MS {
        assert!(windows.iter().sum::<u64>() >= 200, "{context}");
    }
}

#[test]
fn malformed_compute_scripts_exit_2_before_doing_anything() {
    for script in [
        "series 10",
        "maxstall",
        "info maxstall spin kernel 1 1",
        "settled spin kernel 1 1",
        "spin bogus 1 1",
        "spin kernel 1",
        "run kernel x 1",
        "pace kernel 1 1",
        "spin kernel 1 1 series 0",
        "periodic 0 100 2000 3",
        "periodic 1 100 0 3",
        "periodic 1 100 2000",
    ] {
        assert_malformed(script);
    }
}

#[test]
fn probe_fields_parse() {
    let line = "run kernel 1 2 -> 0 launches=7 wall_ns=10 busy_ns=5 share_pm=500";
    assert_eq!(probe_field(line, "launches"), Some(7));
    assert_eq!(probe_field(line, "share_pm"), Some(500));
    assert_eq!(probe_field(line, "wall"), None);
    assert_eq!(probe_field("maxstall ns=x", "ns"), None);
    assert_eq!(BUSY_SYMBOL, "gpushare_double_busy_ns");
}
