//! A move of a pod whose process backs its memory itself
//! (`CUDA_LIMITER_FAST_SWAP`), under a real daemon and the driver double's
//! two GPUs: the process moves its memory to host memory itself, the
//! driver's checkpoint takes only its context, its restore puts the
//! process on the other GPU, and the process brings the same bytes back to
//! the same address there. A pod away by the fast path moves the same way:
//! its context is checkpointed at the move, and its swap-in restores it
//! on the new GPU. A restore that fails, and a daemon restarted while the
//! move waits, leave it to the next swap-in, which finishes it there.

use std::sync::Arc;

use hypervisor_swap::{PodSwap, SwapPath};
use system_tests::RunningNode;
use system_tests::daemon::{self, double_gpus};
use system_tests::pod::Pod;
use system_tests::probes::MIB;
use system_tests::swapping::{Running, admin_cli, control_block};
use system_tests::wait::eventually;

use super::moves::config;

/// What the probe allocates (backed by its limiter) and writes.
const HELD: u64 = 256 * MIB;

/// [`HELD`], written; resumed, checked.
const SCRIPT: &[&str] = &[
    "alloc", "mem", "256m", "write", "0", "9", "wait", "check", "0", "9",
];

/// A daemon of `pod` on the double's two GPUs, and the pod's process,
/// which sees both and backs its memory (`env` added), at its `wait`: the
/// address its memory is at.
fn moving_pod_with(pod: &Pod, env: &[(&str, &str)]) -> (RunningNode, Running, String) {
    let node = daemon::hypervisor(pod, &config(pod, "127.0.0.1:0"), Arc::new(double_gpus(2)));
    let env: Vec<(&str, &str)> = [
        ("GPUSHARE_DOUBLE_DEVICES", "2"),
        ("CUDA_LIMITER_FAST_SWAP", "1"),
    ]
    .into_iter()
    .chain(env.iter().copied())
    .collect();
    let mut running = Running::start(pod, &node.url(), &env, SCRIPT);
    let lines = running.until_ready();
    assert!(lines[1].contains("-> 0 at="), "{lines:?}");
    let at = lines[1].split("at=").nth(1).expect("an address").to_owned();
    eventually("the process is registered", || {
        node.hypervisor().workers_of(&pod.0).len() == 1
    });
    (node, running, at)
}

fn moving_pod(pod: &Pod) -> (RunningNode, Running, String) {
    moving_pod_with(pod, &[])
}

/// Swaps the pod out by the fast path, then moves it to GPU 1: its
/// process checkpointed, not yet restored.
fn away_and_moved(node: &RunningNode, pod: &Pod, running: &Running) {
    let (ok, answer) = admin_cli(node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    let (ok, answer) = admin_cli(node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"path\":\"fast\""), "{answer}");
    assert_eq!(control_block(running.pid()).state, 2, "checkpointed");
}

/// The pod's history after one move, done: nothing under way, its
/// processes restored.
fn moved_once(record: &PodSwap) {
    let history = &record.history;
    assert_eq!(
        (
            history.moves,
            &history.moving,
            history.contexts_checkpointed
        ),
        (1, &None, false),
        "{record:?}"
    );
}

/// The process runs on GPU 1 again, holding `held` as before its move.
fn back_on_the_second_gpu(running: &Running, held: u64) {
    let back = control_block(running.pid());
    assert_eq!(
        (back.state, back.gpu, back.device_bytes),
        (0, 1, held),
        "running on the second GPU with all its memory: {back:?}"
    );
}

/// Lets the probe's trapped call go on: the same bytes at the same address.
fn same_bytes_after(mut running: Running, at: &str) {
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert_eq!(rest[0], "resumed");
    assert!(
        rest[1].starts_with("check 0 9 -> 0 differ=0 at=") && rest[1].ends_with(at),
        "the same bytes at the same address: {rest:?}"
    );
}

#[test]
fn a_pod_that_backs_its_memory_moves_it_itself_and_the_checkpoint_takes_only_its_context() {
    let pod = Pod::new("fast-move");
    let (node, running, at) = moving_pod(&pod);
    let before = control_block(running.pid());
    assert!(before.device_bytes > HELD, "{before:?}");
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"path\":\"fast\""), "{answer}");
    assert!(answer.contains("\"residency\":\"resident\""), "{answer}");
    let after = control_block(running.pid());
    assert_eq!(
        (after.state, after.gpu, after.device_bytes),
        (0, 1, before.device_bytes),
        "running again, on the second GPU, with all its memory"
    );
    let record = node.hypervisor().pod_swap(&pod.0);
    let history = &record.history;
    assert_eq!(
        (history.last_swap_out_path, history.last_swap_in_path),
        (Some(SwapPath::Fast), Some(SwapPath::Fast)),
        "its memory went both ways by the process: {record:?}"
    );
    assert_eq!(history.last_bytes_in, HELD, "{record:?}");
    moved_once(&record);
    same_bytes_after(running, &at);
}

#[test]
fn a_pod_away_by_the_fast_path_moves_with_its_context_and_comes_back_on_the_new_gpu() {
    let pod = Pod::new("fast-move-away");
    let (node, running, at) = moving_pod(&pod);
    let before = control_block(running.pid());

    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    let away = control_block(running.pid());
    assert_eq!(
        (away.state, away.device_bytes),
        (0, before.device_bytes - HELD),
        "its context stays on the GPU: {away:?}"
    );

    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"residency\":\"swapped\""), "{answer}");
    assert!(answer.contains("\"path\":\"fast\""), "{answer}");
    let moved = control_block(running.pid());
    assert_eq!(
        (moved.state, moved.device_bytes, moved.gpu),
        (2, 0, 0),
        "checkpointed, not yet restored: {moved:?}"
    );
    assert_eq!(
        moved.host_bytes, away.device_bytes,
        "the checkpoint took what the process held without its memory: {moved:?}"
    );
    assert!(
        node.hypervisor()
            .pod_swap(&pod.0)
            .history
            .contexts_checkpointed
    );

    // Its swap-in restores it on the second GPU; then its memory comes back.
    let (ok, answer) = admin_cli(&node, &["swap", "in", &pod.0]);
    assert!(ok, "{answer}");
    back_on_the_second_gpu(&running, before.device_bytes);
    same_bytes_after(running, &at);
    let record = node.hypervisor().pod_swap(&pod.0);
    let history = &record.history;
    assert_eq!(
        (history.last_swap_in_path, history.last_bytes_in),
        (Some(SwapPath::Fast), HELD),
        "{record:?}"
    );
    moved_once(&record);
}

#[test]
fn a_restarted_daemon_finishes_the_fast_move_of_a_pod_away() {
    let pod = Pod::new("fast-move-restart");
    let (node, running, at) = moving_pod(&pod);
    let held = control_block(running.pid()).device_bytes;
    away_and_moved(&node, &pod, &running);

    // The new daemon knows neither path nor checkpointed contexts: the
    // move waits in the pod's limits object, and its swap-in restores the
    // process on GPU 1, which then brings its memory back.
    let addr = node.addr();
    node.stop();
    let again = daemon::hypervisor(
        &pod,
        &config(&pod, &addr.to_string()),
        Arc::new(double_gpus(2)),
    );
    eventually("the new daemon shows the move under way", || {
        again.hypervisor().pod_swap(&pod.0).history.moving.is_some()
    });
    eventually("the process is adopted", || {
        again.hypervisor().workers_of(&pod.0).len() == 1
    });
    let (ok, answer) = admin_cli(&again, &["swap", "in", &pod.0]);
    assert!(ok, "{answer}");
    back_on_the_second_gpu(&running, held);
    same_bytes_after(running, &at);
}

#[test]
fn a_fast_move_whose_restore_fails_is_finished_by_the_next_swap_in() {
    // Four refusals: more than one swap-in's tries.
    let pod = Pod::new("fast-move-retry");
    let (node, running, at) =
        moving_pod_with(&pod, &[("GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES", "4")]);
    let held = control_block(running.pid()).device_bytes;
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(!ok && answer.contains("500"), "{answer}");
    let record = node.hypervisor().pod_swap(&pod.0);
    assert!(
        record.history.moving.is_some() && record.history.contexts_checkpointed,
        "{record:?}"
    );
    assert_eq!(control_block(running.pid()).state, 2, "checkpointed");

    let (ok, answer) = admin_cli(&node, &["swap", "in", &pod.0]);
    assert!(ok, "{answer}");
    back_on_the_second_gpu(&running, held);
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        (
            record.history.last_swap_in_path,
            &record.history.moving,
            record.history.contexts_checkpointed,
        ),
        (Some(SwapPath::Fast), &None, false),
        "{record:?}"
    );
    same_bytes_after(running, &at);
}
