//! Priority classes on the driver double's simulated GPU clock: two
//! processes, a latency pod and a batch pod, share a node's priority table;
//! the batch pod's own timeline shows its launches held while the latency
//! pod has work in flight, and released within 1 ms once it goes idle.

mod common;

use std::process::{Command, Stdio};

use common::{Pod, probe, serial};
use gpushare_utils::activity::pod_key;
use gpushare_utils::priority::NodePriority;

const MS: u64 = 1_000_000;
/// The step of the batch probe's `idle` command.
const STEP_NS: u64 = 50_000;

/// `key=value` out of a probe line.
fn field<'a>(lines: &'a [String], prefix: &str, key: &str) -> &'a str {
    lines
        .iter()
        .filter(|line| line.starts_with(prefix))
        .find_map(|line| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        })
        .unwrap_or_else(|| panic!("no {prefix}… {key}= in {lines:?}"))
}

/// The N of each `COMMAND ns=N` line (`clock`, `settled`), in order.
fn times(lines: &[String], command: &str) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix(command)?.strip_prefix(" ns="))
        .map(|n| n.parse().expect("ns"))
        .collect()
}

/// The idle stretches of an `idle STEP at=a-b,…` line.
fn idle(lines: &[String]) -> Vec<(u64, u64)> {
    let spans = field(lines, "idle ", "at");
    spans
        .split(',')
        .filter(|span| !span.is_empty())
        .map(|span| {
            let (a, b) = span.split_once('-').expect("a-b");
            (a.parse().expect("a"), b.parse().expect("b"))
        })
        .collect()
}

/// The probe as one pod of the class, on the test's own tables.
fn pod_probe(pod: &Pod, node: &str, priority: &str, class: &str, args: &[&str]) -> Command {
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_CLASS", class),
            ("GPUSHARE_NODE_REGION", node),
            ("GPUSHARE_PRIORITY_REGION", priority),
        ],
        args,
    );
    command.stdout(Stdio::piped()).stderr(Stdio::piped());
    command
}

fn lines(child: std::process::Child) -> Vec<String> {
    let output = child.wait_with_output().expect("probe");
    common::check(&output);
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn batch_launches_are_held_while_the_latency_pod_is_active() {
    let _serial = serial();
    let (latency, batch) = (Pod::new("latency"), Pod::new("batch"));
    let node = format!("gpushare-node-test-{}", latency.0);
    let priority = format!("gpushare-priority-test-{}", latency.0);
    // The batch pod saturates its GPU with 100 µs kernels for 1.1 s. The
    // latency pod launches once (it is then on the GPU), and 300 ms later
    // queues 50 ms of work in one burst, three times, 150 ms apart.
    let batch_child = pod_probe(
        &batch,
        &node,
        &priority,
        "batch",
        &["run", "kernel", "100", "1100", "idle", "50"],
    )
    .spawn()
    .expect("batch");
    // Each burst is timed from a clock read before it to the end of its
    // work on the latency pod's timeline: a clock read after the synchronize
    // would add however long the process took to run again.
    let burst = [
        "clock", "spin", "kernel", "100", "500", "settled", "sleep", "150",
    ];
    let mut script = vec!["spin", "kernel", "100", "1", "sleep", "300"];
    for _ in 0..3 {
        script.extend(burst);
    }
    let latency_child = pod_probe(&latency, &node, &priority, "latency", &script)
        .spawn()
        .expect("latency");
    let latency_lines = lines(latency_child);
    let batch_lines = lines(batch_child);
    let table = NodePriority::open_named(&priority, false).expect("priority table");

    let (starts, ends) = (
        times(&latency_lines, "clock"),
        times(&latency_lines, "settled"),
    );
    assert_eq!((starts.len(), ends.len()), (3, 3), "{latency_lines:?}");
    let gaps = idle(&batch_lines);
    let context = || format!("idle {gaps:?}\nlatency {latency_lines:?}\nbatch {batch_lines:?}");
    let mut released_us = Vec::new();
    for (&start, &idle_at) in starts.iter().zip(&ends) {
        assert!(idle_at > start, "{}", context());
        // The stretch of the batch timeline that covers the burst: the
        // batch pod stops within its one launch in flight (the stretch is
        // known to the 50 µs step of the `idle` command).
        let gap = gaps
            .iter()
            .find(|(a, b)| *a <= start + 2 * MS && *b + STEP_NS >= idle_at)
            .unwrap_or_else(|| panic!("batch not held over {start}..{idle_at}: {}", context()));
        released_us.push(gap.1.saturating_sub(idle_at) / 1_000);
    }
    // Released within 1 ms of the latency pod going idle; a 2-core CI
    // machine under load may deschedule either process for a few ms once.
    released_us.sort_unstable();
    assert!(
        released_us[1] <= 1_000 && released_us[2] <= 5_000,
        "batch released {released_us:?} µs after the latency pod went idle: {}",
        context()
    );
    assert!(
        batch_lines
            .iter()
            .any(|line| line.starts_with("run ") && line.contains("-> 0 ")),
        "{batch_lines:?}"
    );

    let held = table.stats(pod_key(&batch.0)).expect("batch counters");
    assert!(held.held_ns >= 80 * MS, "held {held:?}");
    assert!(held.held_launches >= 2, "{held:?}");
    let waited = table.stats(pod_key(&latency.0)).expect("latency counters");
    assert_eq!(waited.held_ns, 0, "{waited:?}");
    assert!(waited.queue_samples >= 1, "{waited:?}");
}

/// What one run of a periodic latency pod next to a saturating batch pod saw.
struct Periodic {
    /// The latency pod's request arrivals while the batch pod ran, past the
    /// predictor's warm-up, that came on schedule.
    arrivals: Vec<u64>,
    /// Those that found a batch kernel running.
    collided: usize,
    /// The batch pod's busy share between the first and last of them.
    batch_share: f64,
    /// The period the latency pod published on the device's line.
    period_ns: u64,
    context: String,
}

/// A batch pod launching 200 µs kernels back to back, and a latency pod
/// whose requests (two 100 µs kernels, then a synchronize) arrive every
/// 2 ms on a fixed schedule, classes on, prediction `predict`. The double
/// keeps one timeline per process: a batch kernel was running at an arrival
/// if the batch pod's own timeline was busy then (its idle stretches, known
/// to a 5 µs step, do not cover the arrival).
fn periodic(predict: &str) -> Periodic {
    const STEP_NS: u64 = 5_000;
    /// Requests left out at the start: nine make the first prediction, and
    /// the batch pod finds the table within 100 ms.
    const WARM_UP: usize = 15;
    /// Arrivals later than this behind their due time are left out: the
    /// latency process itself woke late (on a loaded 2-core machine, by a
    /// scheduler tick, ~1 ms, a few requests in a row), and no prediction
    /// can place a request its own process did not make on schedule.
    const ON_TIME_NS: u64 = 200_000;
    const PERIOD_NS: u64 = 2 * MS;
    let (latency, batch) = (Pod::new("periodic-latency"), Pod::new("periodic-batch"));
    let node = format!("gpushare-node-test-{}", latency.0);
    let priority = format!("gpushare-priority-test-{}", latency.0);
    let mut batch_command = pod_probe(
        &batch,
        &node,
        &priority,
        "batch",
        &["clock", "run", "kernel", "200", "800", "idle", "5"],
    );
    // A shallow launch queue: what the batch pod queued before it found the
    // table (up to 1024 kernels by default) would otherwise run for 200 ms
    // whatever the classes say.
    batch_command.env("GPUSHARE_DOUBLE_QUEUE_DEPTH", "4");
    let batch_child = batch_command.spawn().expect("batch");
    // One launch makes the table (the batch pod finds it within 100 ms), 250
    // ms later 120 requests.
    let script = [
        "spin", "kernel", "100", "1", "sleep", "250", "periodic", "2", "100", "2000", "120",
    ];
    let mut latency_command = pod_probe(&latency, &node, &priority, "latency", &script);
    latency_command.env("CUDA_LIMITER_PRIORITY_PREDICT", predict);
    let latency_child = latency_command.spawn().expect("latency");
    let latency_lines = lines(latency_child);
    let batch_lines = lines(batch_child);
    let table = NodePriority::open_named(&priority, false).expect("priority table");
    let period_ns = table
        .device(0)
        .expect("line")
        .period_ns
        .load(std::sync::atomic::Ordering::Relaxed);

    let batch_start = times(&batch_lines, "clock")[0];
    let batch_end = batch_start
        + field(&batch_lines, "run ", "wall_ns")
            .parse::<u64>()
            .expect("wall");
    let gaps = idle(&batch_lines);
    let all: Vec<u64> = field(&latency_lines, "periodic ", "at")
        .split(',')
        .map(|at| at.parse().expect("arrival"))
        .collect();
    // Request i is due PERIOD_NS * i after the first (the probe's schedule).
    let first = all.first().copied().unwrap_or(0);
    let arrivals: Vec<u64> = (0u64..)
        .zip(&all)
        .skip(WARM_UP)
        .filter(|&(i, &at)| at.saturating_sub(first + i * PERIOD_NS) <= ON_TIME_NS)
        .map(|(_, &at)| at)
        .filter(|&at| at > batch_start && at + MS < batch_end)
        .collect();
    let collided = arrivals
        .iter()
        .filter(|&&at| !gaps.iter().any(|&(a, b)| a <= at && at < b))
        .count();
    let (from, to) = (
        arrivals.first().copied().unwrap_or(0),
        arrivals.last().copied().unwrap_or(0),
    );
    let idle_ns: u64 = gaps
        .iter()
        .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
        .sum();
    let span = to.saturating_sub(from).max(STEP_NS);
    Periodic {
        collided,
        batch_share: 1.0 - idle_ns as f64 / span as f64,
        period_ns,
        context: format!(
            "predict={predict} arrivals {arrivals:?}\nidle {gaps:?}\nlatency {latency_lines:?}\nbatch {batch_lines:?}"
        ),
        arrivals,
    }
}

#[test]
fn a_periodic_latency_pod_finds_no_batch_kernel_running_when_it_arrives() {
    let _serial = serial();
    // Where requests land against batch kernels is timing: on a 2-core
    // machine either process may be descheduled for a scheduler tick at a
    // request, a few in a row (stop 26: this test failed 3 of 20 runs on an
    // idle 2-core machine with one try). Three tries; a prediction that does
    // not work fails all three.
    for attempt in 0.. {
        let off = periodic("0");
        let on = periodic("1");
        for run in [&off, &on] {
            assert!(
                run.arrivals.len() >= 50,
                "too few requests overlapped the batch pod: {}",
                run.context
            );
        }
        assert_eq!(off.period_ns, 0, "{}", off.context);
        // Late requests (a descheduled process) can keep the period from
        // being published in one try (CI, stop 29: a request 1.2 ms late,
        // period 0): a try, like the collisions below.
        let published = on.period_ns.abs_diff(2 * MS) <= MS / 10;
        let share = |run: &Periodic| run.collided as f64 / run.arrivals.len() as f64;
        // Without prediction a request arrives while a batch kernel runs most
        // of the time (but for the hold after the previous request); with it,
        // the batch pod is idle when the request comes (seen here: off
        // 38–84%, on 3–22%). The batch pod keeps most of the GPU: requests
        // take 10% of it, the hold after them 5%, the wait for the predicted
        // arrival ~6%.
        let separated = share(&off) >= 0.3
            && share(&on) <= 0.3
            && share(&on) * 2.5 <= share(&off)
            && on.batch_share >= 0.45;
        if published && separated {
            break;
        }
        assert!(
            attempt < 2,
            "published period {} ns; off: {} of {} collided; on: {} of {} collided, batch share {:.3}\n{}\n{}",
            on.period_ns,
            off.collided,
            off.arrivals.len(),
            on.collided,
            on.arrivals.len(),
            on.batch_share,
            off.context,
            on.context
        );
    }
}
