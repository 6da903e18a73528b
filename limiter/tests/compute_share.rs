//! Compute shares on the driver double's simulated GPU clock: every launch
//! API, accuracy, pod-wide sharing, wake-up, elastic ceilings. The tests
//! take turns: each times the limiter against the CPUs it has.

mod common;

use std::process::{Command, Stdio};

use common::{Pod, probe, run, serial};

/// `key=value` out of a probe line.
fn field(line: &str, key: &str) -> i64 {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// The probe under the limiter with a compute limit, its own node table.
fn limited(pod: &Pod, env: &[(&str, &str)], args: &[&str]) -> Command {
    let node = format!("gpushare-node-test-{}", pod.0);
    let mut command = probe("cudaprobe", pod, env, args);
    command.env("GPUSHARE_NODE_REGION", &node);
    command
}

/// The per-window busy fractions of a `series … pm=a,b,c` line.
fn series(line: &str) -> Vec<i64> {
    line.split("pm=")
        .nth(1)
        .expect("series")
        .split(',')
        .filter_map(|value| value.trim().parse().ok())
        .collect()
}

fn share(lines: &[String]) -> i64 {
    let line = lines
        .iter()
        .find(|line| line.starts_with("run ") || line.starts_with("spin "))
        .expect("run line");
    assert!(line.contains("-> 0 "), "launch failed: {line}");
    field(line, "share_pm")
}

#[test]
fn share_matches_the_limit_for_short_and_long_kernels() {
    let _serial = serial();
    for percent in [10, 25, 50, 75] {
        for kernel_us in ["100", "2000"] {
            let pod = Pod::new("share");
            let limit = percent.to_string();
            let lines = run(limited(
                &pod,
                &[("CUDA_DEVICE_SM_LIMIT", &limit)],
                &["run", "kernel", kernel_us, "1500"],
            ));
            let got = share(&lines);
            let want = percent * 10;
            assert!(
                (got - want).abs() <= 30,
                "L={percent}% with {kernel_us} µs kernels: {got}‰ ({lines:?})"
            );
        }
    }
}

#[test]
fn every_launch_api_is_limited() {
    let _serial = serial();
    let apis = [
        "kernel",
        "kernel_ptsz",
        "ex",
        "ex_ptsz",
        "coop",
        "coop_ptsz",
        "graph",
        "graph_ptsz",
        "legacy",
        "grid",
        "grid_async",
    ];
    for api in apis {
        for via in [&["--via", "dlsym"][..], &["--via", "getproc"][..]] {
            let pod = Pod::new("apis");
            let args: Vec<&str> = via
                .iter()
                .copied()
                .chain(["run", api, "500", "800"])
                .collect();
            let lines = run(limited(
                &pod,
                &[
                    ("CUDA_LIMITER_SM_LIMIT", "40"),
                    ("GPUSHARE_DOUBLE_KERNEL_NS", "500000"),
                ],
                &args,
            ));
            let got = share(&lines);
            assert!((got - 400).abs() <= 40, "{api} {via:?}: {got}‰ ({lines:?})");
        }
    }
}

#[test]
fn without_a_compute_limit_launches_run_free() {
    let _serial = serial();
    let pod = Pod::new("free");
    let lines = run(limited(
        &pod,
        &[("CUDA_DEVICE_MEMORY_LIMIT", "4g")],
        &["run", "kernel", "1000", "500"],
    ));
    assert!(share(&lines) >= 950, "{lines:?}");
}

#[test]
fn the_share_settles_within_a_second_and_stalls_stay_short() {
    let _serial = serial();
    let pod = Pod::new("settle");
    let lines = run(limited(
        &pod,
        &[("CUDA_DEVICE_SM_LIMIT", "25")],
        &["run", "kernel", "2000", "2000", "series", "250", "maxstall"],
    ));
    let series = series(&lines[1]);
    assert!(series.len() >= 7, "{lines:?}");
    // Every window after the first second within ±3 pp.
    for window in &series[4..series.len() - 1] {
        assert!((window - 250).abs() <= 30, "{series:?}");
    }
    // At 25% a 2 ms kernel earns its budget back in 8 ms: no launch waits
    // much longer than that (sleeps are at most 2 ms, and precise).
    let stall = field(&lines[2], "ns");
    assert!(stall < 12_000_000, "largest stall {stall} ns");
}

#[test]
fn two_processes_of_one_pod_share_one_budget() {
    let _serial = serial();
    let pod = Pod::new("pod-share");
    let spawn = || {
        limited(
            &pod,
            &[("CUDA_DEVICE_SM_LIMIT", "50")],
            &["run", "kernel", "1000", "1500"],
        )
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn")
    };
    let (first, second) = (spawn(), spawn());
    let shares: Vec<i64> = [first, second]
        .into_iter()
        .map(|child| {
            let output = child.wait_with_output().expect("wait");
            common::check(&output);
            let lines: Vec<String> = String::from_utf8_lossy(&output.stdout)
                .lines()
                .map(str::to_owned)
                .collect();
            share(&lines)
        })
        .collect();
    let total: i64 = shares.iter().sum();
    assert!((total - 500).abs() <= 40, "{shares:?}");
}

#[test]
fn a_host_bound_program_is_not_slowed_by_a_limit_it_stays_under() {
    let _serial = serial();
    let pod = Pod::new("pace");
    let script = ["pace", "kernel", "5", "2000", "50"];
    let free = run(limited(&pod, &[], &script));
    let limited_run = run(limited(&pod, &[("CUDA_DEVICE_SM_LIMIT", "50")], &script));
    let (free, limited_run) = (
        field(&free[0], "ns_per_iter"),
        field(&limited_run[0], "ns_per_iter"),
    );
    // The GPU is 10% busy: a 50% limit must not bind. CI timing is noisy;
    // the 3% bound is measured on the GPU machine.
    assert!(
        limited_run < free + free / 5,
        "{free} ns free, {limited_run} ns limited"
    );
}

#[test]
fn elastic_pods_use_idle_time_and_give_it_back() {
    let _serial = serial();
    let pod = Pod::new("elastic");
    let node = format!("gpushare-node-test-{}", pod.0);
    let elastic = [
        ("CUDA_LIMITER_SM_LIMIT", "30"),
        ("CUDA_LIMITER_SM_POLICY", "elastic"),
    ];
    // Alone on the node: up to the whole GPU.
    let alone = run(limited(&pod, &elastic, &["run", "kernel", "1000", "800"]));
    assert!(share(&alone) >= 900, "{alone:?}");

    // Another pod starts launching: back to 30% within a second.
    let other_pod = Pod::new("elastic-other");
    let mut other = probe(
        "cudaprobe",
        &other_pod,
        &[("CUDA_DEVICE_SM_LIMIT", "50")],
        &["run", "kernel", "1000", "3000"],
    );
    other
        .env("GPUSHARE_NODE_REGION", &node)
        .stdout(Stdio::null());
    let mut other = other.spawn().expect("spawn other pod");
    std::thread::sleep(std::time::Duration::from_millis(300));
    let shared = run(limited(
        &pod,
        &elastic,
        &["run", "kernel", "1000", "2000", "series", "250"],
    ));
    let series = series(&shared[1]);
    other.wait().expect("other pod");
    for window in &series[4..series.len() - 1] {
        assert!((window - 300).abs() <= 40, "{series:?}");
    }
    let _ignored = std::fs::remove_file(format!("/dev/shm/{node}"));
}

/// The exit summary of the probe running `script` under a compute limit of
/// `percent`, with `env` on top.
struct Summary(String);

impl Summary {
    fn of(percent: &str, env: &[(&str, &str)], script: &[&str]) -> Self {
        let pod = Pod::new("summary");
        let mut vars = vec![
            ("CUDA_DEVICE_SM_LIMIT", percent),
            ("CUDA_LIMITER_LOG", "info"),
        ];
        vars.extend_from_slice(env);
        let output = limited(&pod, &vars, script).output().expect("spawn probe");
        common::check(&output);
        Self::in_stderr(&String::from_utf8_lossy(&output.stderr))
    }

    fn in_stderr(stderr: &str) -> Self {
        let line = stderr
            .lines()
            .find(|line| line.contains("compute summary:"))
            .unwrap_or_else(|| panic!("no summary in {stderr}"));
        Self(line.to_owned())
    }

    fn number(&self, key: &str) -> f64 {
        self.0
            .split_whitespace()
            .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
            .and_then(|value| value.parse().ok())
            .unwrap_or_else(|| panic!("no {key} in {}", self.0))
    }
}

#[test]
fn the_exit_summary_tells_a_binding_limit_from_a_free_run() {
    let _serial = serial();
    // A saturating loop at 25%: charged about a quarter of the time, and
    // most of the run spent waiting for budget.
    let bound = Summary::of("25", &[], &["run", "kernel", "500", "600"]);
    let share = bound.number("charged_share");
    assert!((0.2..=0.3).contains(&share), "share {share}");
    let waited = bound.number("waited_for_budget_ms");
    assert!(waited > 300.0, "waited {waited} ms of a 600 ms run");
    let launches = bound.number("pod_launches");
    assert!(launches > 100.0, "{launches} launches");
    // A loop 10% busy under a 50% limit: charged about 10%, never waits.
    let free = Summary::of("50", &[], &["pace", "kernel", "5", "2000", "50"]);
    let share = free.number("charged_share");
    assert!((0.05..=0.2).contains(&share), "share {share}");
    let waited = free.number("waited_for_budget_ms");
    assert!(
        waited < 1.0,
        "waited {waited} ms under a limit that does not bind"
    );
}

#[test]
fn a_limit_that_does_not_bind_measures_launches_rarely_and_rests_the_monitor() {
    let _serial = serial();
    // A sample costs driver calls on the launching thread: where the limit
    // does not bind, about one per 4 ms of GPU time charged (this loop, 5 µs
    // kernels every ~50 µs, is charged about a tenth of its time: one per
    // ~40 ms), never more than one per 16 ms (plus a few by the clock while
    // the bucket fills and the rate is first measured); where it binds,
    // about one per 2 ms, for prices that decide what runs. The strides
    // between samples are random: at 25 of them the count spreads by about
    // ±3 (one standard deviation); one per 16 ms would be about 57, one per
    // 2 ms 460.
    let free = Summary::of("50", &[], &["pace", "kernel", "5", "20000", "45"]);
    let (samples, wall_ms) = (free.number("samples"), free.number("wall_ms"));
    assert!(wall_ms > 500.0, "{}", free.0);
    assert!(
        samples <= wall_ms / 16.0 * 1.25 + 8.0,
        "{samples} samples in {wall_ms} ms not bound ({})",
        free.0
    );
    let charged_ms = free.number("pod_charged_ms");
    assert!(
        charged_ms < wall_ms / 4.0,
        "a light loop charged {charged_ms} ms in {wall_ms} ({})",
        free.0
    );
    assert!(
        samples <= charged_ms / 4.0 * 1.25 + 8.0,
        "{samples} samples for {charged_ms} ms of GPU time charged in {wall_ms} ms ({})",
        free.0
    );
    // The monitor reads those samples when each wakes it, a poll or two
    // while the kernel runs, and checks contention every 50 ms; it does
    // not nap every millisecond as it does while the limit binds (about
    // 850 wake-ups in this run).
    let wakeups = free.number("monitor_wakeups");
    assert!(
        wakeups <= 3.0 * samples + wall_ms / 50.0 + 10.0,
        "{wakeups} monitor wake-ups for {samples} samples in {wall_ms} ms ({})",
        free.0
    );
    let bound = Summary::of("25", &[], &["run", "kernel", "100", "1000"]);
    let (samples, wall_ms) = (bound.number("samples"), bound.number("wall_ms"));
    assert!(
        samples >= wall_ms / 2.0 / 2.0,
        "{samples} samples in {wall_ms} ms bound ({})",
        bound.0
    );
}

#[test]
fn a_loop_busy_again_after_idling_is_not_measured_at_every_launch() {
    let _serial = serial();
    // A server between requests: 100 ms idle, then a paced loop, four
    // times. The rate measured across the idle gap is one launch an
    // interval; drawn from it, the strides sampled every launch of the next
    // 16 ms (223 and 249 samples in two runs, against 71 and 78 now).
    let mut args = vec!["pace", "kernel", "5", "10", "45"];
    for _ in 0..4 {
        args.extend(["sleep", "100", "pace", "kernel", "5", "4000", "45"]);
    }
    let summary = Summary::of("50", &[], &args);
    let (samples, wall_ms) = (summary.number("samples"), summary.number("wall_ms"));
    assert!(wall_ms > 500.0, "{}", summary.0);
    assert!(
        samples <= wall_ms / 16.0 * 1.25 + 8.0,
        "{samples} samples in {wall_ms} ms ({})",
        summary.0
    );
}

#[test]
fn a_first_launch_that_loads_its_module_is_not_priced_at_the_load() {
    let _serial = serial();
    // CUDA loads a module lazily, inside the first launch of one of its
    // functions (milliseconds). That launch's bracket holds the load: priced
    // at it, every launch of the function until the price recovers would be
    // charged milliseconds, and a limit that does not bind would.
    let summary = Summary::of(
        "50",
        &[("GPUSHARE_DOUBLE_LAZY_LOAD_US", "30000")],
        &["pace", "kernel", "5", "4000", "50"],
    );
    // About 10% busy: charged about that, never waiting for budget.
    let share = summary.number("charged_share");
    assert!(share < 0.25, "charged {share} of the time ({})", summary.0);
    let waited = summary.number("waited_for_budget_ms");
    assert!(waited < 1.0, "waited {waited} ms ({})", summary.0);
    assert!(summary.number("discarded_samples") >= 1.0, "{}", summary.0);
}

#[test]
fn a_launch_call_slower_than_calibrated_is_not_charged_as_gpu_time() {
    let _serial = serial();
    // A program that runs each of its functions once (a JIT per shape) pays
    // a module load inside every launch call: tens of µs of host time, under
    // the bound past which a sample is dropped. From an idle stream the
    // bracket holds it, since the kernel starts only once the call is done;
    // priced at it, the 20 µs kernels of a loop 10-15% busy cost a 50%
    // limit (4.5x their GPU time, about 150 ms waited, here).
    let summary = Summary::of(
        "50",
        &[("GPUSHARE_DOUBLE_LAZY_LOAD_US", "10")],
        &["functions", "3000", "20", "3000", "50"],
    );
    // 3,000 measured launches and the warm-up: 20 µs each on the double.
    let busy_ms = summary.number("pod_launches") * 0.020;
    let charged_ms = summary.number("pod_charged_ms");
    assert!(
        charged_ms <= 2.0 * busy_ms && charged_ms >= 0.5 * busy_ms,
        "charged {charged_ms} ms for {busy_ms} ms of kernels ({})",
        summary.0
    );
    let waited = summary.number("waited_for_budget_ms");
    assert!(waited < 1.0, "waited {waited} ms ({})", summary.0);
}

#[test]
fn without_its_monitor_thread_the_limiter_still_measures_and_holds_the_limit() {
    let _serial = serial();
    // A pod at its limit of threads: the monitor cannot start, and launching
    // threads read the measurements. Before, each launch of a function after
    // its first waited the longest for a measurement nobody read: 5 ms, a
    // loop 100 times slower.
    let preload = format!(
        "{} {}",
        common::limiter().display(),
        gpushare_examples::fail_limiter_threads().display()
    );
    let without_monitor = |percent: &str, script: &[&str]| {
        let pod = Pod::new("no-monitor");
        let env = [
            ("LD_PRELOAD", preload.as_str()),
            ("CUDA_DEVICE_SM_LIMIT", percent),
            ("CUDA_LIMITER_LOG", "info"),
        ];
        let output = limited(&pod, &env, script).output().expect("spawn probe");
        common::check(&output);
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(stderr.contains("cannot start the monitor"), "{stderr}");
        let summary = Summary::in_stderr(&stderr);
        let lines: Vec<String> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(str::to_owned)
            .collect();
        (lines, summary)
    };

    // 50 µs of host work and a 5 µs kernel: about 55 µs an iteration.
    let (lines, summary) = without_monitor("50", &["pace", "kernel", "5", "2000", "50"]);
    let per_iteration = field(&lines[0], "ns_per_iter");
    assert!(
        per_iteration < 100_000,
        "{per_iteration} ns ({})",
        summary.0
    );
    let held = summary.number("held_for_measurements_ms");
    assert!(held < 20.0, "held {held} ms ({})", summary.0);
    assert_eq!(summary.number("monitor_wakeups"), 0.0, "{}", summary.0);

    // A limit that binds holds: prices come from measurements, not from the
    // first guess (20 µs a wave, 25 times too little for 500 µs kernels).
    let (lines, summary) = without_monitor("25", &["run", "kernel", "500", "1000"]);
    let got = share(&lines);
    assert!((got - 250).abs() <= 30, "{got}‰ ({})", summary.0);
}
