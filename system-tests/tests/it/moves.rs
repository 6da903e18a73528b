//! Moving a pod between the GPUs of a node, under a real daemon and the
//! driver double's checkpoint API with two GPUs: the pod's process keeps
//! its memory and its CUDA device number, now on the other GPU, and finds
//! its quota and usage there; a reload and a restarted daemon keep it
//! where it was moved; a drain moves every pod off a GPU, or swaps it out
//! where Kubernetes placed it, and a GPU that reports an XID is drained by
//! itself; what cannot move is refused with the reason. A process of the
//! pod that exited holds up none of these.

use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::limits::{PodLimits, Residency};
use gpushare_utils::shm::Trust;
use hypervisor_observer::{GpuObserver, HealthEvent};
use system_tests::daemon::{self, double_gpus, node_file_gpus};
use system_tests::pod::Pod;
use system_tests::probes::GIB;
use system_tests::swapping::{
    ADMIN, Running, TOKEN, admin_cli, ask_room, checkpoint_dir, control_block,
};
use system_tests::wait::eventually;

#[ctor::ctor(unsafe)]
fn name_the_checkpoint_folder() {
    // SAFETY: a constructor, run while this process has one thread.
    unsafe { system_tests::swapping::name_the_checkpoint_folder() };
}

/// The probes see both of the double's GPUs, as a process without
/// `CUDA_VISIBLE_DEVICES` sees a node's.
const TWO_GPUS: (&str, &str) = ("GPUSHARE_DOUBLE_DEVICES", "2");

/// 1 GiB, then, resumed, 1 GiB more.
const ONE_GIB_THEN_MORE: &[&str] = &["alloc", "mem", "1g", "wait", "alloc", "mem", "1g"];

/// The config of a daemon of `pod` (4 GiB on GPU 0) listening on `listen`.
pub(super) fn config(pod: &Pod, listen: &str) -> String {
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    format!(
        "listen = \"{listen}\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"4g\"\n",
        library.display(),
        pod.0
    )
}

fn start(pod: &Pod) -> system_tests::RunningNode {
    daemon::hypervisor(pod, &config(pod, "127.0.0.1:0"), Arc::new(double_gpus(2)))
}

/// Stops `node` and starts a daemon of the same config on its port, which
/// the probes' limiters reach.
fn restarted(pod: &Pod, node: system_tests::RunningNode) -> system_tests::RunningNode {
    let addr = node.addr();
    node.stop();
    daemon::hypervisor(
        pod,
        &config(pod, &addr.to_string()),
        Arc::new(double_gpus(2)),
    )
}

/// The pod's quota on the GPU `uuid` as its limits object says; `None`:
/// it has none there.
fn quota_on(pod: &Pod, uuid: &str) -> Option<u64> {
    let limits = PodLimits::open_read_only(&pod.0, &Trust::own_or_root(None)).expect("limits");
    limits
        .find(uuid)
        .map(|gpu| gpu.quota.load(std::sync::atomic::Ordering::Acquire))
}

/// A daemon for a new pod `name`, and a probe of the pod seeing both GPUs
/// (`env` added) that ran `script` up to its `wait`.
fn pod_waiting(
    name: &str,
    env: &[(&str, &str)],
    script: &[&str],
) -> (Pod, system_tests::RunningNode, Running) {
    let pod = Pod::new(name);
    let node = start(&pod);
    let env: Vec<(&str, &str)> = [TWO_GPUS].into_iter().chain(env.iter().copied()).collect();
    let mut running = Running::start(&pod, &node.url(), &env, script);
    let first = running.until_ready();
    assert!(first[0].contains("-> 0 "), "{first:?}");
    (pod, node, running)
}

/// Resumes a probe whose script ends `wait alloc mem 1g` (or more) and
/// checks that it runs to its end with the 1 GiB allocated.
fn resumed_and_allocated(mut running: Running) -> Vec<String> {
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
    rest
}

#[test]
fn a_moved_pod_keeps_its_memory_and_its_quota_on_the_other_gpu() {
    let (pod, node, mut running) = pod_waiting(
        "move-pod",
        &[],
        &[
            "alloc", "mem", "2g", "wait", "info", "alloc", "mem", "1g", "alloc", "mem", "2g",
        ],
    );
    let block = control_block(running.pid());
    assert_eq!(block.gpu, 0);
    assert!(block.device_bytes >= 2 * GIB, "{block:?}");

    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    let first = gpushare_examples::uuid(0);
    let second = gpushare_examples::uuid(1);
    assert!(answer.contains(&format!("\"to\":\"{second}\"")), "{answer}");
    let moved = control_block(running.pid());
    assert_eq!(
        (moved.state, moved.gpu, moved.device_bytes),
        (0, 1, block.device_bytes),
        "running again, on the second GPU, with all its memory"
    );
    assert_eq!(quota_on(&pod, &second), Some(4 * GIB), "the quota followed");
    assert_eq!(
        quota_on(&pod, &first),
        None,
        "nothing left on the first GPU"
    );
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        (record.history.moves, &record.history.moving),
        (1, &None),
        "{record:?}"
    );
    let metrics = daemon::metrics(&node.url());
    assert!(metrics.contains("gpushare_moves_total 1"), "{metrics}");

    // The process's device 0 is the second GPU now; its usage and quota
    // are there: 1 GiB more fits, 2 GiB more does not.
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert_eq!(rest[0], "resumed");
    assert!(
        rest[1].starts_with("info 0 free=") && rest[1].ends_with(&format!("total={}", 4 * GIB)),
        "{rest:?}"
    );
    assert!(
        rest[2].contains("-> 0 "),
        "1 GiB more fits the quota: {rest:?}"
    );
    assert!(rest[3].contains("-> 2 "), "2 GiB more is over it: {rest:?}");
}

#[test]
fn a_moved_pod_stays_moved_through_a_restart_of_the_daemon() {
    let (pod, node, running) = pod_waiting(
        "move-restart",
        &[],
        &[
            "alloc", "mem", "3g", "wait", "alloc", "mem", "512m", "alloc", "mem", "1g",
        ],
    );
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    // The config still places the pod on GPU 0; its limits say it moved.
    let again = restarted(&pod, node);
    let second = gpushare_examples::uuid(1);
    eventually("the new daemon places the pod where it was moved", || {
        quota_on(&pod, &second) == Some(4 * GIB)
    });
    assert_eq!(quota_on(&pod, &gpushare_examples::uuid(0)), None);
    let rest = resumed_and_allocated(running);
    assert!(rest[2].contains("-> 2 "), "the quota holds: {rest:?}");
    // Back to the GPU its config names: the move is forgotten.
    let (ok, answer) = admin_cli(&again, &["move", &pod.0, "--to", "0"]);
    assert!(ok, "{answer}");
    assert_eq!(quota_on(&pod, &gpushare_examples::uuid(0)), Some(4 * GIB));
}

#[test]
fn a_drain_moves_pods_off_a_gpu_or_swaps_those_kubernetes_placed() {
    let (pod, node, running) = pod_waiting("move-drain", &[], ONE_GIB_THEN_MORE);

    for (args, refusal) in [
        (vec!["move", &pod.0, "--to", "0"], "409"),
        (vec!["move", &pod.0, "--to", "5"], "409"),
        (vec!["move", "no-such-pod", "--to", "1"], "404"),
        (vec!["drain", "7"], "404"),
    ] {
        let (ok, answer) = admin_cli(&node, &args);
        assert!(!ok, "{args:?}: {answer}");
        assert!(answer.contains(refusal), "{args:?}: {answer}");
    }
    assert_eq!(control_block(running.pid()).gpu, 0, "nothing moved");

    let (ok, answer) = admin_cli(&node, &["drain", "0"]);
    assert!(ok, "{answer}");
    let report: serde_json::Value = serde_json::from_str(answer.trim()).expect("JSON");
    assert_eq!(report["moved"][0]["pod"], pod.0.as_str(), "{report}");
    assert_eq!(report["swapped"], serde_json::json!([]), "{report}");
    assert_eq!(control_block(running.pid()).gpu, 1);

    // Where Kubernetes gave the pod its GPU it may not move: a drain swaps
    // it out instead, and its next call brings it back to the same GPU.
    node.hypervisor().pin_placements();
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "0"]);
    assert!(
        !ok && answer.contains("409") && answer.contains("Kubernetes"),
        "{answer}"
    );
    let (ok, answer) = admin_cli(&node, &["drain", "1"]);
    assert!(ok, "{answer}");
    let report: serde_json::Value = serde_json::from_str(answer.trim()).expect("JSON");
    assert_eq!(report["swapped"], serde_json::json!([pod.0]), "{report}");
    assert_eq!(report["moved"], serde_json::json!([]), "{report}");
    let block = control_block(running.pid());
    assert_eq!((block.state, block.device_bytes), (2, 0), "in host memory");
    resumed_and_allocated(running);
}

#[test]
fn a_move_whose_restore_fails_is_finished_by_the_pods_next_call() {
    // Four refusals: more than one swap-in's tries.
    let (pod, node, running) = pod_waiting(
        "move-retry",
        &[("GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES", "4")],
        ONE_GIB_THEN_MORE,
    );
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(!ok && answer.contains("500"), "{answer}");
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        record.history.moving.as_ref().map(|m| m.to.as_str()),
        Some(gpushare_examples::uuid(1).as_str()),
        "{record:?}"
    );
    assert_eq!(control_block(running.pid()).state, 2, "in host memory");
    resumed_and_allocated(running);
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        (record.history.moves, &record.history.moving),
        (1, &None),
        "{record:?}"
    );
}

#[test]
fn a_swapped_pod_moved_comes_back_on_the_new_gpu_at_its_next_call() {
    let (pod, node, running) = pod_waiting("move-swapped", &[], ONE_GIB_THEN_MORE);
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"residency\":\"swapped\""), "{answer}");
    assert_eq!(
        control_block(running.pid()).state,
        2,
        "still in host memory"
    );
    assert_eq!(quota_on(&pod, &gpushare_examples::uuid(1)), Some(4 * GIB));
    resumed_and_allocated(running);
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        (record.history.moves, &record.history.moving),
        (1, &None),
        "{record:?}"
    );
}

#[test]
fn a_restarted_daemon_finishes_the_move_of_a_swapped_pod() {
    let (pod, node, running) = pod_waiting("move-swapped-restart", &[], ONE_GIB_THEN_MORE);
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    // The new daemon finds the move waiting in the pod's limits object.
    let again = restarted(&pod, node);
    eventually("the new daemon shows the move under way", || {
        again.hypervisor().pod_swap(&pod.0).history.moving.is_some()
    });
    assert_eq!(control_block(running.pid()).state, 2, "still checkpointed");
    let (ok, answer) = admin_cli(&again, &["swap", "in", &pod.0]);
    assert!(ok, "{answer}");
    assert_eq!(
        control_block(running.pid()).gpu,
        1,
        "restored on the GPU it moved to"
    );
    resumed_and_allocated(running);
    let record = again.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.history.moving, None, "{record:?}");
    let limits = PodLimits::open_read_only(&pod.0, &Trust::own_or_root(None)).expect("limits");
    assert_eq!(limits.pending_move(), None);
}

#[test]
fn a_swapped_pod_moved_away_and_back_is_restored_where_it_was() {
    let (pod, node, running) = pod_waiting("move-back", &[], ONE_GIB_THEN_MORE);
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    for to in ["1", "0"] {
        let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", to]);
        assert!(ok, "{answer}");
    }
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        record.history.moving, None,
        "nothing left to move: {record:?}"
    );
    assert_eq!(quota_on(&pod, &gpushare_examples::uuid(0)), Some(4 * GIB));
    let (ok, answer) = admin_cli(&node, &["swap", "in", &pod.0]);
    assert!(ok, "{answer}");
    assert_eq!(control_block(running.pid()).gpu, 0, "restored in place");
    resumed_and_allocated(running);
}

#[test]
fn a_gpu_that_reports_an_xid_is_drained_by_itself() {
    let pod = Pod::new("move-xid");
    let gpus = Arc::new(double_gpus(2));
    let text = config(&pod, "127.0.0.1:0").replace("[swap]\n", "[swap]\ndrain_unhealthy = true\n");
    let node = daemon::hypervisor(&pod, &text, Arc::clone(&gpus) as Arc<dyn GpuObserver>);
    let mut running = Running::start(&pod, &node.url(), &[TWO_GPUS], ONE_GIB_THEN_MORE);
    running.until_ready();
    assert_eq!(control_block(running.pid()).gpu, 0);

    assert!(gpus.inject(0, HealthEvent::Xid(Some(79))).expect("GPU 0"));
    eventually("the pod leaves the GPU that reported the XID", || {
        control_block(running.pid()).gpu == 1
    });
    eventually("the move is over", || {
        node.hypervisor().pod_swap(&pod.0).history.moves == 1
    });
    // Nothing goes to the unhealthy GPU.
    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "0"]);
    assert!(!ok && answer.contains("unhealthy (xid-79)"), "{answer}");
    resumed_and_allocated(running);
}

#[test]
fn a_room_wait_that_ends_mid_swap_leaves_the_pod_whole_and_a_move_takes_its_processes() {
    // A pod of two processes, 5 GiB each, on the first of two 16 GiB GPUs
    // the probes share; an asker there whose room waits 300 ms.
    let pod = Pod::new("move-cancelled");
    let asker = Pod::new("move-cancelled-asker");
    let node_file = checkpoint_dir().join(format!("{}.node", pod.0));
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n\
         overcommit = true\nidle_after_ms = 200\nroom_wait_ms = 300\nhost_limit = \"64g\"\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n[[pods.gpus]]\nindex = 0\nmemory = \"12g\"\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n[[pods.gpus]]\nindex = 0\nmemory = \"10g\"\n",
        library.display(),
        pod.0,
        asker.0
    );
    let gpus = node_file_gpus(node_file.clone(), 16 * GIB, 2);
    let node = daemon::hypervisor(&pod, &text, Arc::new(gpus));
    let env = [
        TWO_GPUS,
        (
            gpushare_examples::NODE_FILE_VAR,
            node_file.to_str().expect("a path"),
        ),
    ];
    let mut survivor = Running::start(
        &pod,
        &node.url(),
        &env,
        &["alloc", "mem", "5g", "wait", "info", "alloc", "mem", "1g"],
    );
    let mut stopped = Running::start(&pod, &node.url(), &env, &["alloc", "mem", "5g", "wait"]);
    for running in [&mut survivor, &mut stopped] {
        let lines = running.until_ready();
        assert!(lines[0].contains("-> 0 "), "{lines:?}");
    }
    let mut asking = Running::start(&asker, &node.url(), &env, &["alloc", "mem", "256m", "wait"]);
    asking.until_ready();
    std::thread::sleep(Duration::from_millis(400));

    // The lock of a stopped process waits; the room's wait ends first.
    let stopped_pid = i32::try_from(stopped.pid()).expect("a pid");
    // SAFETY: a signal to the test's own child.
    assert_eq!(unsafe { libc::kill(stopped_pid, libc::SIGSTOP) }, 0);
    let uuid = gpushare_examples::uuid(0);
    let answer = ask_room(&node, &asker, &uuid, 8 * GIB);
    assert_eq!(
        (answer.freed, answer.room),
        (0, false),
        "no room within 300 ms"
    );
    // Then the lock fails: its process is gone.
    stopped.child.kill().expect("kill the stopped probe");
    let _ = stopped.child.wait();
    eventually("the swap is over", || {
        node.hypervisor().pod_swap(&pod.0).state != Residency::SwappingOut
    });
    // The swap ended whole either way: undone (the process gone counted
    // as a failed lock) or done (the process gone is done with), and the
    // pod's limits say what the driver holds.
    let record = node.hypervisor().pod_swap(&pod.0);
    let block = control_block(survivor.pid());
    assert!(
        matches!(
            (record.state, block.state),
            (Residency::Resident, 0) | (Residency::Swapped, 2)
        ),
        "a swap left half-done: {record:?}, driver state {}",
        block.state
    );
    let limits = PodLimits::open_read_only(&pod.0, &Trust::own_or_root(None)).expect("limits");
    assert_eq!(limits.residency(), record.state);
    if record.state == Residency::Swapped {
        let (ok, answer) = admin_cli(&node, &["swap", "in", &pod.0]);
        assert!(ok, "{answer}");
        assert_eq!(control_block(survivor.pid()).state, 0, "{answer}");
    }

    // A move takes the process with the limits, or nothing moves.
    let (moved, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    let gpu = u8::from(moved);
    let block = control_block(survivor.pid());
    assert_eq!(block.gpu, u32::from(gpu), "{answer}");
    assert_eq!(
        quota_on(&pod, &gpushare_examples::uuid(gpu)),
        Some(12 * GIB),
        "{answer}"
    );
    survivor.resume();
    let (rest, status) = survivor.finish();
    assert!(status.success(), "{rest:?}");
    assert!(
        rest[1].starts_with("info 0 ") && rest[1].ends_with(&format!("total={}", 12 * GIB)),
        "{rest:?}"
    );
    assert!(rest[2].contains("-> 0 "), "its allocations work: {rest:?}");
    let (rest, status) = asking.finish();
    assert!(status.success(), "{rest:?}");
}

#[test]
fn an_exited_process_of_the_pod_holds_up_no_move_drain_or_swap() {
    let (pod, node, running) = pod_waiting("move-exited", &[], ONE_GIB_THEN_MORE);
    // A second process of the pod registers, then dies; its worker stays
    // registered until its silence passes the channel's TTL.
    let mut exited = Running::start(&pod, &node.url(), &[TWO_GPUS], ONE_GIB_THEN_MORE);
    exited.until_ready();
    exited.child.kill().expect("kill the probe");
    let _ = exited.child.wait();

    let (ok, answer) = admin_cli(&node, &["move", &pod.0, "--to", "1"]);
    assert!(ok, "{answer}");
    assert_eq!(control_block(running.pid()).gpu, 1);
    let (ok, answer) = admin_cli(&node, &["drain", "1"]);
    assert!(ok, "{answer}");
    let report: serde_json::Value = serde_json::from_str(answer.trim()).expect("JSON");
    assert_eq!(report["moved"][0]["pod"], pod.0.as_str(), "{report}");
    assert_eq!(control_block(running.pid()).gpu, 0);
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    assert_eq!(control_block(running.pid()).state, 2);
    resumed_and_allocated(running);
}
