//! Priority classes on the driver double's simulated GPU clock: two
//! processes, a latency pod and a batch pod, share a node's priority table;
//! the batch pod's own timeline shows its launches held while the latency
//! pod has work in flight, and released within 1 ms once it goes idle.

mod common;

use std::process::{Command, Stdio};

use common::{Pod, probe};
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

/// The `clock ns=N` lines, in order.
fn clocks(lines: &[String]) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix("clock ns="))
        .map(|n| n.parse().expect("clock"))
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
    let burst = [
        "clock", "spin", "kernel", "100", "500", "clock", "sleep", "150",
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

    let clocks = clocks(&latency_lines);
    assert_eq!(clocks.len(), 6, "{latency_lines:?}");
    let gaps = idle(&batch_lines);
    let context = || format!("idle {gaps:?}\nlatency {latency_lines:?}\nbatch {batch_lines:?}");
    let mut released_us = Vec::new();
    for burst in clocks.chunks(2) {
        let (start, idle_at) = (burst[0], burst[1]);
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
