//! Compute shares on the driver double's simulated GPU clock: every launch
//! API, accuracy, pod-wide sharing, wake-up, elastic ceilings. The tests
//! take turns: each times the limiter against the CPUs it has.
//!
//! What they assert holds on a loaded machine: a share never exceeds its
//! limit, and falls short of it by no more than the time the launching
//! thread waited for a CPU (`common::assert_share`); what a run costs in
//! time (stalls, a paced loop's speed) is measured by the `double_timing`
//! benchmark, and asserted here only where the alternative is an order of
//! magnitude away.

use crate::common;

use std::process::{Command, Stdio};

use common::{Pod, assert_share, delay_pm, number, probe, run, serial};

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

/// The `run` or `spin` line of a probe's output, checked for success.
fn run_line(lines: &[String]) -> &str {
    let line = lines
        .iter()
        .find(|line| line.starts_with("run ") || line.starts_with("spin "))
        .expect("run line");
    assert!(line.contains("-> 0 "), "launch failed: {line}");
    line
}

fn share(lines: &[String]) -> i64 {
    number(run_line(lines), "share_pm")
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
            assert_share(run_line(&lines), percent * 10, 30);
        }
    }
}

#[test]
fn a_kernel_slowed_by_the_event_before_it_is_charged_its_back_to_back_time() {
    let _serial = serial();
    // On the double every kernel right after an event takes 10 µs longer,
    // as a real kernel whose launch ramp overlaps the one before it except
    // after an event: a bracket reads 60 µs where the loop spends 50. Runs
    // of launches measured end to end bring the price down to what the
    // loop takes: the share is the limit, not five sixths of it.
    let ramp = [("GPUSHARE_DOUBLE_EVENT_RAMP_NS", "10000")];
    let summary = Summary::of("50", &ramp, &["run", "kernel", "50", "1500"]);
    assert_share(run_line(&summary.1), 500, 30);
    let scale = summary.number("bracket_scale");
    assert!((0.8..0.9).contains(&scale), "scale {scale}: {}", summary.0);
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
            assert_share(run_line(&lines), 400, 40);
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
    let line = run_line(&lines);
    assert!(share(&lines) >= 950 - delay_pm(line), "{lines:?}");
}

#[test]
fn the_share_settles_within_a_second_and_no_launch_sleeps_through_refills() {
    let _serial = serial();
    let pod = Pod::new("settle");
    let lines = run(limited(
        &pod,
        &[("CUDA_DEVICE_SM_LIMIT", "25")],
        &["run", "kernel", "2000", "2000", "series", "250", "maxstall"],
    ));
    let series = series(&lines[1]);
    assert!(series.len() >= 7, "{lines:?}");
    // Every window after the first second within ±3 pp; below that by at
    // most the time the thread waited for a CPU, which at worst all fell
    // in one window.
    let delay_ns = number(&lines[0], "delay_ns");
    let window_delay = delay_ns * 1000 / 250_000_000;
    for window in &series[4..series.len() - 1] {
        assert!(
            *window <= 280 && *window >= 220 - window_delay,
            "{series:?} (thread waited {delay_ns} ns for a CPU)"
        );
    }
    // At 25% a 2 ms kernel earns its budget back in 8 ms, and a waiting
    // launch sleeps at most 2 ms at a time (the double_timing benchmark
    // prints the stalls: about 9 ms on an idle machine). A launch that
    // waited 50 ms more than the scheduler kept it from running slept
    // through six refills: woken by something other than its budget.
    let stall = number(&lines[2], "ns");
    assert!(
        stall < 50_000_000 + delay_ns,
        "largest stall {stall} ns (thread waited {delay_ns} ns for a CPU)"
    );
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
    let shares: Vec<(i64, i64)> = [first, second]
        .into_iter()
        .map(|child| {
            let output = child.wait_with_output().expect("wait");
            common::check(&output);
            let lines = common::stdout_lines(&output);
            (share(&lines), delay_pm(run_line(&lines)))
        })
        .collect();
    // Each process's shortfall is bounded by its own wait for a CPU.
    let total: i64 = shares.iter().map(|(share, _)| share).sum();
    let delay: i64 = shares.iter().map(|(_, delay)| delay).sum();
    assert!(
        total <= 540 && total >= 460 - delay,
        "{shares:?} (share‰, run delay‰)"
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
    assert!(
        share(&alone) >= 900 - delay_pm(run_line(&alone)),
        "{alone:?}"
    );

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
    // Below 30% by at most the thread's wait for a CPU, all in one window.
    let window_delay = number(&shared[0], "delay_ns") * 1000 / 250_000_000;
    for window in &series[4..series.len() - 1] {
        assert!(
            *window <= 340 && *window >= 260 - window_delay,
            "{series:?} ({shared:?})"
        );
    }
    let _ignored = std::fs::remove_file(format!("/dev/shm/{node}"));
}

/// The exit summary of the probe running `script` under a compute limit of
/// `percent`, with `env` on top, and the probe's output lines.
struct Summary(String, Vec<String>);

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
        Self::of_output(&output)
    }

    fn of_output(output: &std::process::Output) -> Self {
        let line = common::summary_of(output)
            .unwrap_or_else(|| panic!("no summary in {}", String::from_utf8_lossy(&output.stderr)));
        let lines = common::stdout_lines(output);
        Self(line, lines)
    }

    /// The run delay of the probe's first measured command, in ms.
    fn delay_ms(&self) -> f64 {
        number(&self.1[0], "delay_ns") as f64 / 1e6
    }

    fn number(&self, key: &str) -> f64 {
        common::summary_number(&self.0, key)
    }
}

#[test]
fn the_exit_summary_tells_a_binding_limit_from_a_free_run() {
    let _serial = serial();
    // A saturating loop at 25%: charged about a quarter of the time, and
    // most of the run spent waiting for budget (less whatever time the
    // thread waited for a CPU instead).
    let bound = Summary::of("25", &[], &["run", "kernel", "500", "600"]);
    let delay_ms = bound.delay_ms();
    let share = bound.number("charged_share");
    let wall_ms = bound.number("wall_ms");
    assert!(
        share <= 0.3 && share >= 0.2 - delay_ms / wall_ms,
        "share {share}, thread waited {delay_ms} ms for a CPU ({})",
        bound.0
    );
    let waited = bound.number("waited_for_budget_ms");
    assert!(
        waited > 300.0 - delay_ms,
        "waited {waited} ms of a 600 ms run ({})",
        bound.0
    );
    let launches = bound.number("pod_launches");
    assert!(launches > 100.0, "{launches} launches");
    // A loop 10% busy (5 µs kernels after 50 µs of host work) under a 50%
    // limit: charged what its kernels took, never waits. A limit it stays
    // under costs it no launch held (what it costs in time is the
    // double_timing benchmark's figure).
    let free = Summary::of("50", &[], &["pace", "kernel", "5", "2000", "50"]);
    let share = free.number("charged_share");
    let kernels_ms = free.number("pod_launches") * 0.005;
    let charged_ms = free.number("pod_charged_ms");
    assert!(
        share <= 0.2 && charged_ms >= 0.5 * kernels_ms,
        "charged {charged_ms} ms for {kernels_ms} ms of kernels ({})",
        free.0
    );
    let waited = free.number("waited_for_budget_ms");
    assert!(
        waited < 1.0,
        "waited {waited} ms under a limit that does not bind ({})",
        free.0
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
    // A thread that waits for a CPU launches nothing meanwhile: the time
    // it ran is what counts here.
    let bound = Summary::of("25", &[], &["run", "kernel", "100", "1000"]);
    let (samples, wall_ms) = (bound.number("samples"), bound.number("wall_ms"));
    assert!(
        samples >= (wall_ms - bound.delay_ms()) / 2.0 / 2.0,
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
        Summary::of_output(&output)
    };

    // 50 µs of host work and a 5 µs kernel: about 55 µs an iteration, where
    // a launch waiting for its measurement took 5 ms. Less than 1 ms, plus
    // the iteration's share of the time the thread waited for a CPU.
    let summary = without_monitor("50", &["pace", "kernel", "5", "2000", "50"]);
    let per_iteration = number(&summary.1[0], "ns_per_iter");
    let delay_per_iteration = number(&summary.1[0], "delay_ns") / 2000;
    assert!(
        per_iteration < 1_000_000 + delay_per_iteration,
        "{per_iteration} ns ({})",
        summary.0
    );
    let held = summary.number("held_for_measurements_ms");
    assert!(held < 20.0, "held {held} ms ({})", summary.0);
    assert_eq!(summary.number("monitor_wakeups"), 0.0, "{}", summary.0);

    // A limit that binds holds: prices come from measurements, not from the
    // first guess (20 µs a wave, 25 times too little for 500 µs kernels).
    let summary = without_monitor("25", &["run", "kernel", "500", "1000"]);
    assert_share(run_line(&summary.1), 250, 30);
}
