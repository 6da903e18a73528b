//! Turns on the driver double: two batch pods on one GPU that takes turns
//! (`CUDA_LIMITER_TURN_MS`, without a hypervisor) launch one pod at a time.
//! The double keeps one timeline per process, so each pod's device idles
//! through the other's turns: each is busy about half the run, in stretches
//! of turns, and the node's turn line counts the handovers. The same pods
//! without turns keep their devices busy all along.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::Stdio;

use crate::common;

use common::{Pod, class_probe, number, serial};
use gpushare_utils::limits::uuid_key;
use gpushare_utils::node_table::TableAccess;
use gpushare_utils::priority::NodePriority;

/// Each pod launches 200 µs kernels for this long.
const RUN_MS: &str = "600";

struct Ran {
    /// Per pod: its device's busy share of the run (per mille), the
    /// stretches it idled for 1 ms or more, and its wait for a CPU (ns).
    pods: Vec<(i64, usize, i64)>,
    handovers: u64,
    /// Per pod, the limiter's exit summary, where `env` asks for one.
    summaries: Vec<Option<String>>,
}

/// Two batch pods sharing node tables, run at once with `env`.
fn run_pair(env: &[(&str, &str)]) -> Ran {
    run_pods([env, env])
}

/// Two batch pods sharing node tables, run at once, each with its `envs`.
/// Both start their runs together: each waits, set up, until both are, so
/// that neither launches alone while the other is still loading (on a
/// loaded machine that can take longer than the activity stamps' window).
fn run_pods(envs: [&[(&str, &str)]; 2]) -> Ran {
    let (a, b) = (Pod::new("turns-a"), Pod::new("turns-b"));
    let node = format!("gpushare-node-test-{}", a.0);
    let priority = format!("gpushare-priority-test-{}", a.0);
    let args = ["wait", "run", "kernel", "200", RUN_MS, "idle", "1000"];
    let mut children: Vec<_> = [&a, &b]
        .iter()
        .zip(envs)
        .map(|(pod, env)| {
            // At most 4 kernels queued, as a real GPU's launch queue
            // would fill: the device idles once its pod stops launching.
            let mut child = class_probe(pod, &node, &priority, "batch", &args)
                .env("GPUSHARE_DOUBLE_QUEUE_DEPTH", "4")
                .envs(env.iter().copied())
                .stdin(Stdio::piped())
                .spawn()
                .expect("probe");
            let mut stdout = BufReader::new(child.stdout.take().expect("stdout"));
            let mut seen = Vec::new();
            while !seen.ends_with(b"ready\n") {
                let before = seen.len();
                stdout.read_until(b'\n', &mut seen).expect("probe");
                assert!(seen.len() > before, "the probe ended early: {seen:?}");
            }
            (child, seen, stdout)
        })
        .collect();
    for (child, _, _) in &mut children {
        let stdin = child.stdin.as_mut().expect("stdin");
        writeln!(stdin).expect("probe");
    }
    let outputs: Vec<_> = children
        .into_iter()
        .map(|(child, mut seen, mut stdout)| {
            // The rest of stdout read beside stderr, so that neither fills.
            let rest = std::thread::spawn(move || {
                stdout.read_to_end(&mut seen).expect("probe");
                seen
            });
            let mut output = child.wait_with_output().expect("probe");
            output.stdout = rest.join().expect("stdout");
            output
        })
        .collect();
    let summaries = outputs.iter().map(common::summary_of).collect();
    let pods = outputs
        .iter()
        .map(|output| {
            common::check(output);
            let lines = common::stdout_lines(output);
            let run = lines
                .iter()
                .find(|line| line.starts_with("run "))
                .unwrap_or_else(|| panic!("{lines:?}"));
            let idle = common::line_field(&lines, "idle ", "at");
            let stretches = idle.split(',').filter(|span| !span.is_empty()).count();
            (number(run, "share_pm"), stretches, number(run, "delay_ns"))
        })
        .collect();
    let handovers = NodePriority::open_named(&priority, &TableAccess::managed(None))
        .ok()
        .and_then(|table| {
            let gpu = uuid_key(&gpushare_examples::uuid(0));
            Some(table.turn_line(gpu)?.view(0).handovers)
        })
        .unwrap_or(0);
    Ran {
        pods,
        handovers,
        summaries,
    }
}

#[test]
fn batch_pods_of_a_gpu_that_takes_turns_launch_one_at_a_time() {
    let _serial = serial();
    let turns = run_pair(&[("CUDA_LIMITER_TURN_MS", "5")]);
    let context = format!("{:?}, {} handovers", turns.pods, turns.handovers);
    // 600 ms in turns of 5 ms: about 60 handovers; each pod idles through
    // the other's turns, each a stretch of about 5 ms.
    assert!(turns.handovers >= 20, "{context}");
    for &(share_pm, stretches, _) in &turns.pods {
        assert!(share_pm <= 750, "busy beside the other's turns: {context}");
        assert!(stretches >= 15, "{context}");
    }
    // Turns hand over promptly: together the pods kept a device busy most
    // of the run, less what a loaded machine took from them.
    let busy: i64 = turns.pods.iter().map(|pod| pod.0).sum();
    let delayed_pm = turns.pods.iter().map(|pod| pod.2).max().unwrap_or(0) / 600_000;
    assert!(busy + delayed_pm >= 700, "{context}");

    let free = run_pair(&[]);
    let context = format!("{:?}, {} handovers", free.pods, free.handovers);
    assert_eq!(free.handovers, 0, "{context}");
    for &(share_pm, _, delay_ns) in &free.pods {
        assert!(share_pm + delay_ns / 600_000 >= 850, "{context}");
    }
}

#[test]
fn a_pod_that_holds_its_turn_is_measured_as_alone_on_the_gpu() {
    let _serial = serial();
    // Two pods capped at 60% of the GPU, taking turns of 5 ms, which their
    // budgets let them use whole: each sees the other launch within the
    // activity stamps' window all along, but not while it holds its turn.
    // Measurements taken then count as the GPU's only work: runs of
    // launches, which count only then, set the bracket scale.
    let limited = [
        ("CUDA_LIMITER_SM_LIMIT", "60"),
        ("CUDA_LIMITER_LOG", "info"),
    ];
    let turns = run_pair(&[limited[0], limited[1], ("CUDA_LIMITER_TURN_MS", "5")]);
    let free = run_pair(&limited);
    for (ran, taking_turns) in [(&turns, true), (&free, false)] {
        let context = format!("{:?}, {} handovers", ran.summaries, ran.handovers);
        for summary in &ran.summaries {
            let summary = summary.as_deref().unwrap_or_else(|| panic!("{context}"));
            let runs = common::summary_number(summary, "runs");
            let counted = common::summary_number(summary, "runs_counted");
            assert!(runs >= 4.0, "{context}");
            if taking_turns {
                assert!(counted >= 2.0, "runs inside its turns count: {context}");
            } else {
                assert_eq!(counted, 0.0, "time-sliced beside another pod: {context}");
            }
            let share = common::summary_number(summary, "charged_share");
            assert!((0.3..=0.62).contains(&share), "{context}");
        }
    }
}

#[test]
fn a_capped_pod_banks_a_turn_while_it_waits_for_one() {
    let _serial = serial();
    // Turns of 20 ms; pod a capped at 40%, pod b uncapped, which uses its
    // turns whole. Waiting for 20 ms, a earns 8 ms of GPU time: banked as
    // deep as a turn, it runs 40% of the time; at the default depth (5 ms)
    // it would forfeit 3 ms a round and run about 29%.
    let turn = ("CUDA_LIMITER_TURN_MS", "20");
    let capped = [
        ("CUDA_LIMITER_SM_LIMIT", "40"),
        ("CUDA_LIMITER_LOG", "info"),
        turn,
    ];
    let ran = run_pods([&capped, &[turn]]);
    let context = format!(
        "{:?}, {:?}, {} handovers",
        ran.pods, ran.summaries, ran.handovers
    );
    let summary = ran.summaries[0]
        .as_deref()
        .unwrap_or_else(|| panic!("{context}"));
    assert!(ran.handovers >= 10, "{context}");
    let share = common::summary_number(summary, "charged_share");
    assert!((0.35..=0.44).contains(&share), "{context}");
    let forfeited = common::summary_number(summary, "pod_forfeited_ms");
    let wall = common::summary_number(summary, "wall_ms");
    assert!(forfeited <= wall * 0.03, "{context}");
}
