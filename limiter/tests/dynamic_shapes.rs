//! Compute shares on launches whose shape keeps changing, as inference
//! servers' do: an unbounded stream of new grid sizes, and more functions
//! than the limiter's table holds, on the driver double's simulated clock
//! (a kernel lasts its parameter per wave of 132 × 16 blocks of 128 threads).

mod common;

use std::process::Command;

use common::{Pod, probe, run, serial};

/// `key=value` out of a probe line.
fn field(line: &str, key: &str) -> u64 {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// The probe's one measured line, checked for success.
fn measured(command: Command) -> String {
    let lines = run(command);
    let line = lines.into_iter().next().expect("a result line");
    assert!(line.contains("-> 0 "), "launch failed: {line}");
    line
}

/// The probe's measured line with the limiter loaded, a compute limit if
/// `limit` is given, its own node table (removed after the run).
fn probe_at(pod: &Pod, limit: Option<&str>, args: &[&str]) -> String {
    let node = format!("gpushare-node-test-{}", pod.0);
    let mut command = probe("cudaprobe", pod, &[], args);
    command.env("GPUSHARE_NODE_REGION", &node);
    if let Some(limit) = limit {
        command.env("CUDA_DEVICE_SM_LIMIT", limit);
    }
    let line = measured(command);
    let _ignored = std::fs::remove_file(format!("/dev/shm/{node}"));
    line
}

/// Median `ns_per_iter` without and with a limit of `limit`, from `rounds`
/// alternated runs of `args`.
fn paced(limit: &str, args: &[&str], rounds: usize) -> (u64, u64) {
    let mut free = Vec::new();
    let mut limited = Vec::new();
    for _ in 0..rounds {
        let pod = Pod::new("free");
        free.push(field(&probe_at(&pod, None, args), "ns_per_iter"));
        let pod = Pod::new("limited");
        limited.push(field(&probe_at(&pod, Some(limit), args), "ns_per_iter"));
    }
    let median = |values: &mut Vec<u64>| {
        values.sort_unstable();
        values[values.len() / 2]
    };
    (median(&mut free), median(&mut limited))
}

/// `args` (a paced loop) under a 50% limit it does not need keeps at least
/// 85% of its launches/s.
fn keeps_throughput_at_half(args: &[&str]) {
    // Timed runs busy-wait on the host: one at a time, or on a small
    // machine they would measure each other.
    let _serial = serial();
    let (free, limited) = paced("50", args, 3);
    let ratio = free as f64 / limited as f64;
    assert!(
        ratio >= 0.85,
        "launches/s with a 50% limit / without: {ratio:.3} ({free} vs {limited} ns per iteration)"
    );
}

#[test]
fn an_unbounded_stream_of_new_shapes_keeps_a_non_binding_limits_throughput() {
    // 20,000 distinct grid sizes, 1 to 10 waves of 1 µs each, after 20 µs
    // of host work: the GPU is busy about a fifth of the time, so 50% must
    // not bind. Pricing each new shape by a default would.
    keeps_throughput_at_half(&["shapes", "20000", "1", "20000", "20"]);
}

#[test]
fn more_functions_than_the_table_holds_do_not_slow_launches_down() {
    // 6,000 distinct functions (the limiter's table has 4,096 entries),
    // launched in turn with 20 µs of host work between: a full table must
    // cost no more than an empty one.
    keeps_throughput_at_half(&["functions", "6000", "1", "12000", "20"]);
}

#[test]
fn a_saturating_loop_of_new_shapes_gets_its_share() {
    // No host work: the GPU is the bottleneck, and 3,000 distinct grid sizes
    // (1 or 2 waves of 50 µs) must still get 25% of its time.
    // Timed runs busy-wait on the host: one at a time, or on a small
    // machine they would measure each other.
    let _serial = serial();
    for attempt in 0.. {
        let pod = Pod::new("shapes-share");
        let line = probe_at(&pod, Some("25"), &["shapes", "3000", "50", "6000", "0"]);
        let share = field(&line, "share_pm") as i64;
        if (share - 250).abs() <= 30 {
            break;
        }
        // A loaded CI machine can starve a run: three tries.
        assert!(attempt < 2, "share {share}‰ at a 25% limit: {line}");
    }
}
