//! Running the double's probe programs with the built limiter preloaded.
//! The support the system tests share too comes from `system_tests`,
//! re-exported here; the rest is what only the limiter's own tests (and
//! `benches/double_timing.rs`) use: the probes' three ways to the driver,
//! the exit summary's figures, timelines on the double's simulated clock
//! and the priority scenarios.

// Each test binary uses some of this module.
#![allow(dead_code, unused_imports)]

use std::process::Command;

pub(crate) mod hypervisor;

pub(crate) use system_tests::artifacts::limiter;
pub(crate) use system_tests::pod::Pod;
pub(crate) use system_tests::probes::{
    CONTEXT_BYTES, GIB, MIB, assert_share, assert_share_of, check, delay_pm, info, line_field,
    number, probe, result_of, run, serial, stdout_lines, use_node_tables,
};

/// The probe programs and how each reaches the driver: linked, `dlsym`,
/// `cuGetProcAddress`.
pub(crate) const VIAS: [(&str, &[&str]); 3] = [
    ("cudaprobe_linked", &[]),
    ("cudaprobe", &["--via", "dlsym"]),
    ("cudaprobe", &["--via", "getproc"]),
];

/// The limiter's exit summary (`compute summary: …`) in a process's
/// stderr, where it printed one (`CUDA_LIMITER_LOG=info`).
pub(crate) fn summary_of(output: &std::process::Output) -> Option<String> {
    String::from_utf8_lossy(&output.stderr)
        .lines()
        .find(|line| line.contains("compute summary:"))
        .map(str::to_owned)
}

/// `key=value` of the limiter's exit summary (`compute summary: …`), whose
/// figures may have decimals.
pub(crate) fn summary_number(summary: &str, key: &str) -> f64 {
    summary
        .split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {summary}"))
}

/// The N of each `COMMAND ns=N` line (`clock`, `settled`), in order.
pub(crate) fn times(lines: &[String], command: &str) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix(command)?.strip_prefix(" ns="))
        .map(|rest| rest.split_whitespace().next().unwrap_or(rest))
        .map(|n| n.parse().expect("ns"))
        .collect()
}

/// The idle stretches of an `idle STEP at=a-b,…` line.
pub(crate) fn idle_spans(lines: &[String]) -> Vec<(u64, u64)> {
    line_field(lines, "idle ", "at")
        .split(',')
        .filter(|span| !span.is_empty())
        .map(|span| {
            let (a, b) = span.split_once('-').expect("a-b");
            (a.parse().expect("a"), b.parse().expect("b"))
        })
        .collect()
}

/// The probe as one pod of priority class `class`, on its own node and
/// priority tables, its output piped.
pub(crate) fn class_probe(
    pod: &Pod,
    node: &str,
    priority: &str,
    class: &str,
    args: &[&str],
) -> Command {
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
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    command
}

/// A finished child's stdout lines, failing the test on a non-zero exit.
pub(crate) fn output_lines(child: std::process::Child) -> Vec<String> {
    let output = child.wait_with_output().expect("probe");
    check(&output);
    stdout_lines(&output)
}

/// One burst of [`Bursts`]: its start, when the latency pod went idle, and
/// the stretch of the batch pod's timeline that covers it (`None`: the
/// batch pod was not held), CLOCK_MONOTONIC ns.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hold {
    pub start: u64,
    pub idle_at: u64,
    pub gap: Option<(u64, u64)>,
}

/// A latency pod's bursts next to a saturating batch pod, as each saw them
/// (the pods' objects are removed when this drops).
pub(crate) struct Bursts {
    pub latency: Pod,
    pub batch: Pod,
    /// The priority table's name.
    pub priority: String,
    pub latency_lines: Vec<String>,
    pub batch_lines: Vec<String>,
}

impl Bursts {
    /// The batch pod saturates its GPU with 100 µs kernels for 1.1 s. The
    /// latency pod launches once (it is then on the GPU), and 300 ms later
    /// queues 50 ms of work in one burst, three times, 150 ms apart. Each
    /// burst is timed from a clock read before it to the end of its work on
    /// the latency pod's timeline: a clock read after the synchronize would
    /// add however long the process took to run again.
    pub(crate) fn run() -> Self {
        Self::run_with(&[], &[])
    }

    /// [`Bursts::run`] with `latency_env` set for the latency pod and
    /// `batch_env` for the batch pod.
    pub(crate) fn run_with(latency_env: &[(&str, &str)], batch_env: &[(&str, &str)]) -> Self {
        let (latency, batch) = (Pod::new("latency"), Pod::new("batch"));
        let node = format!("gpushare-node-test-{}", latency.0);
        let priority = format!("gpushare-priority-test-{}", latency.0);
        let batch_child = class_probe(
            &batch,
            &node,
            &priority,
            "batch",
            &["run", "kernel", "100", "1100", "idle", "50"],
        )
        .envs(batch_env.iter().copied())
        .spawn()
        .expect("batch");
        let burst = [
            "clock", "spin", "kernel", "100", "500", "settled", "sleep", "150",
        ];
        let mut script = vec!["spin", "kernel", "100", "1", "sleep", "300"];
        for _ in 0..3 {
            script.extend(burst);
        }
        let latency_child = class_probe(&latency, &node, &priority, "latency", &script)
            .envs(latency_env.iter().copied())
            .spawn()
            .expect("latency");
        let latency_lines = output_lines(latency_child);
        let batch_lines = output_lines(batch_child);
        Self {
            latency,
            batch,
            priority,
            latency_lines,
            batch_lines,
        }
    }

    /// The priority table the pods shared.
    pub(crate) fn table(&self) -> gpushare_utils::priority::NodePriority {
        let access = gpushare_utils::node_table::TableAccess::managed(None);
        gpushare_utils::priority::NodePriority::open_named(&self.priority, &access)
            .expect("priority table")
    }

    /// Per burst, how the batch pod was held over it. The batch pod stops
    /// within its one launch in flight (2 ms of its work on the GPU) of the
    /// latency pod's first launch, which comes after the burst's clock read
    /// by however long the latency pod then waited for a CPU (its burst's
    /// `delay_ns`). What counts is the batch pod's work on the GPU, not the
    /// clock: a batch launch that passed its gate just before the burst may
    /// reach the GPU a scheduler tick later when the machine is loaded. The
    /// stretch is known to the 50 µs step of `idle`.
    pub(crate) fn holds(&self) -> Vec<Hold> {
        const STEP_NS: u64 = 50_000;
        const IN_FLIGHT_NS: u64 = 2_000_000;
        let gaps = idle_spans(&self.batch_lines);
        let starts = times(&self.latency_lines, "clock");
        let ends = times(&self.latency_lines, "settled");
        // Each burst's spin line follows its clock line.
        let delays = self
            .latency_lines
            .windows(2)
            .filter(|pair| pair[0].starts_with("clock "))
            .map(|pair| number(&pair[1], "delay_ns") as u64);
        starts
            .iter()
            .zip(&ends)
            .zip(delays)
            .map(|((&start, &idle_at), delay)| {
                let gap = gaps
                    .iter()
                    .find(|(a, b)| *a <= idle_at && *b + STEP_NS >= idle_at)
                    .copied()
                    .filter(|&(a, _)| busy_ns(&gaps, start + delay, a) <= IN_FLIGHT_NS);
                Hold {
                    start,
                    idle_at,
                    gap,
                }
            })
            .collect()
    }
}

/// How long a timeline whose idle stretches are `gaps` was busy from `from`
/// to `to` (0 when `to` is not after `from`).
fn busy_ns(gaps: &[(u64, u64)], from: u64, to: u64) -> u64 {
    let idle: u64 = gaps
        .iter()
        .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
        .sum();
    to.saturating_sub(from).saturating_sub(idle)
}

/// A periodic latency pod next to a saturating batch pod, both running (the
/// pods' objects are removed when this drops).
pub(crate) struct Periodic {
    pub latency: Pod,
    pub batch: Pod,
    /// The priority table's name.
    pub priority: String,
    pub latency_child: std::process::Child,
    pub batch_child: std::process::Child,
}

impl Periodic {
    /// Starts the batch pod's `batch_script` (its launches of 200 µs kernels
    /// back to back) on a shallow launch queue, then the latency pod: one
    /// launch makes the table, and 250 ms later 120 requests (two 100 µs
    /// kernels, then a synchronize) are due every 2 ms, prediction `predict`.
    pub(crate) fn start(predict: &str, batch_script: &[&str]) -> Self {
        let (latency, batch) = (Pod::new("periodic-latency"), Pod::new("periodic-batch"));
        let node = format!("gpushare-node-test-{}", latency.0);
        let priority = format!("gpushare-priority-test-{}", latency.0);
        let mut batch_command = class_probe(&batch, &node, &priority, "batch", batch_script);
        // A shallow launch queue: what the batch pod queued before it found
        // the table (up to 1024 kernels by default) would otherwise run for
        // 200 ms whatever the classes say.
        batch_command.env("GPUSHARE_DOUBLE_QUEUE_DEPTH", "4");
        let batch_child = batch_command.spawn().expect("batch");
        let script = [
            "spin", "kernel", "100", "1", "sleep", "250", "periodic", "2", "100", "2000", "120",
        ];
        let mut latency_command = class_probe(&latency, &node, &priority, "latency", &script);
        latency_command.env("CUDA_LIMITER_PRIORITY_PREDICT", predict);
        let latency_child = latency_command.spawn().expect("latency");
        Self {
            latency,
            batch,
            priority,
            latency_child,
            batch_child,
        }
    }
}
