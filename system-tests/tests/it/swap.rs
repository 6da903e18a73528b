//! Swap under a real daemon and the driver double's checkpoint API: an idle
//! pod goes to host memory and its next CUDA call brings it back with its
//! quota; what the driver refuses leaves the pod running; a refused restore
//! is tried again; a pod whose process exits while away frees its host
//! memory; a restarted daemon finds a swapped pod and brings it back; on a
//! GPU that overcommits, pods that need memory take it from idle ones, and
//! a pod that cannot come back for want of room waits, refused, without
//! a restore tried in vain, until room is there. A
//! pod cannot have a neighbour's process swapped by naming its pid, nor
//! block swaps by naming pid 1; host memory is counted by what the
//! processes hold, whatever their ledger says.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gpushare_utils::limits::Residency;
use system_tests::daemon::{double_gpus, node_file_gpus, process_gpus};
use system_tests::pod::Pod;
use system_tests::probes::{self, GIB, probe};
use system_tests::swapping::{
    ADMIN, Running, TOKEN, admin_cli, ask_room, ask_room_saying, checkpoint_dir, control_block,
    name_in_ledger, post, write_ledger_usage,
};
use system_tests::wait::eventually;
use system_tests::{RunningNode, daemon};

#[ctor::ctor(unsafe)]
fn name_the_checkpoint_folder() {
    // SAFETY: a constructor, run while this process has one thread.
    unsafe { system_tests::swapping::name_the_checkpoint_folder() };
}

fn config(pod: &Pod, quota: &str, extra_swap: &str) -> String {
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n{extra_swap}\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"{quota}\"\n",
        library.display(),
        pod.0
    )
}

fn start(pod: &Pod, quota: &str) -> RunningNode {
    daemon::hypervisor(pod, &config(pod, quota, ""), Arc::new(double_gpus(1)))
}

/// `hypervisor swap out|in POD` against `node`: its exit status and output.
fn cli_swap(node: &RunningNode, direction: &str, pod: &Pod) -> (bool, String) {
    admin_cli(node, &["swap", direction, &pod.0])
}

fn pod_swap(node: &RunningNode, pod: &Pod) -> hypervisor_swap::PodSwap {
    node.hypervisor().pod_swap(&pod.0)
}

/// A daemon that makes room on `devices` GPUs of 16 GiB that the probes
/// share through `node_file` (a pod idle after 200 ms), for `pods`, each
/// with a quota on one GPU (its index).
fn overcommitted(node_file: &Path, devices: u8, pods: &[(&Pod, u32, &str)]) -> RunningNode {
    overcommitted_within(node_file, devices, pods, "64g")
}

/// [`overcommitted`], with `host_limit` host memory for swapped pods.
fn overcommitted_within(
    node_file: &Path,
    devices: u8,
    pods: &[(&Pod, u32, &str)],
    host_limit: &str,
) -> RunningNode {
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let mut text = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n\
         overcommit = true\nidle_after_ms = 200\nhost_limit = \"{host_limit}\"\n",
        library.display()
    );
    for (pod, index, quota) in pods {
        text.push_str(&format!(
            "\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n[[pods.gpus]]\nindex = {index}\nmemory = \"{quota}\"\n",
            pod.0
        ));
    }
    let gpus = node_file_gpus(node_file.to_owned(), 16 * GIB, devices);
    daemon::hypervisor(pods[0].0, &text, Arc::new(gpus))
}

/// The environment of a probe that sees the double's `devices` GPUs
/// through `node_file`, its CUDA device 0 being the GPU `gpu`.
fn on_gpu(node_file: &Path, devices: u8, gpu: u8) -> Vec<(&'static str, String)> {
    vec![
        (
            gpushare_examples::NODE_FILE_VAR,
            node_file.to_str().expect("a path").to_owned(),
        ),
        ("GPUSHARE_DOUBLE_DEVICES", devices.to_string()),
        ("CUDA_VISIBLE_DEVICES", gpu.to_string()),
    ]
}

fn env<'a>(vars: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    vars.iter()
        .map(|(key, value)| (*key, value.as_str()))
        .collect()
}

#[test]
fn an_idle_pod_goes_to_host_memory_and_its_next_call_brings_it_back() {
    let pod = Pod::new("swap-idle");
    let node = start(&pod, "4g");
    let mut running = Running::start(
        &pod,
        &node.url(),
        &[],
        &[
            "alloc", "mem", "2g", "wait", "info", "alloc", "mem", "1g", "alloc", "mem", "2g",
        ],
    );
    let before = running.until_ready();
    assert!(before[0].contains("-> 0 "), "{before:?}");
    let held = control_block(running.pid()).device_bytes;
    assert!(held >= 2 * GIB, "the probe holds {held} bytes on the GPU");

    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"residency\":\"swapped\""), "{answer}");
    let block = control_block(running.pid());
    let (state, on_host, on_device) = (block.state, block.host_bytes, block.device_bytes);
    assert_eq!(
        (state, on_device),
        (2, 0),
        "checkpointed, nothing on the GPU"
    );
    assert_eq!(on_host, held, "all of it in host memory");
    let record = pod_swap(&node, &pod);
    assert_eq!(record.state, Residency::Swapped);
    assert!(record.history.bytes_on_host >= 2 * GIB, "{record:?}");
    let metrics = daemon::metrics(&node.url());
    assert!(metrics.contains("gpushare_swapped_pods 1"), "{metrics}");

    // The next CUDA call is held by the limiter, which asks for the pod back.
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert_eq!(rest[0], "resumed");
    let total = 4 * GIB;
    assert!(rest[1].starts_with("info 0 free="), "{rest:?}");
    assert!(rest[1].ends_with(&format!("total={total}")), "{rest:?}");
    assert!(
        rest[2].contains("-> 0 "),
        "1 GiB more fits the quota: {rest:?}"
    );
    assert!(rest[3].contains("-> 2 "), "2 GiB more is over it: {rest:?}");
    let record = pod_swap(&node, &pod);
    assert_eq!(record.state, Residency::Resident);
    assert_eq!(
        (record.history.swap_outs, record.history.swap_ins),
        (1, 1),
        "{record:?}"
    );
    assert_eq!(record.history.bytes_on_host, 0);
}

#[test]
fn a_pod_the_driver_cannot_checkpoint_runs_on_with_the_reason() {
    let pod = Pod::new("swap-managed");
    let node = start(&pod, "4g");
    let mut running = Running::start(
        &pod,
        &node.url(),
        &[],
        &["alloc", "managed", "1g", "wait", "alloc", "mem", "1g"],
    );
    let before = running.until_ready();
    assert!(before[0].contains("-> 0 "), "{before:?}");
    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(!ok, "managed memory cannot be checkpointed: {answer}");
    assert!(answer.contains("409"), "{answer}");
    assert!(answer.contains("cuCheckpointProcessCheckpoint"), "{answer}");
    let block = control_block(running.pid());
    let (state, on_device) = (block.state, block.device_bytes);
    assert_eq!(state, 0, "running again");
    assert!(on_device >= GIB);
    let record = pod_swap(&node, &pod);
    assert_eq!(record.state, Residency::Resident);
    assert_eq!(record.history.failures, 1);
    assert!(record.history.last_error.is_some(), "{record:?}");
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
}

#[test]
fn a_restore_the_driver_refuses_is_tried_again_until_the_pod_is_back() {
    let pod = Pod::new("swap-retry");
    let node = start(&pod, "4g");
    // Four refusals: more than one swap-in's tries, so the first swap-in
    // fails and the pod stays in host memory; the trapped call asks again.
    let mut running = Running::start(
        &pod,
        &node.url(),
        &[("GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES", "4")],
        &["alloc", "mem", "1g", "wait", "alloc", "mem", "1g"],
    );
    running.until_ready();
    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    let (ok, answer) = cli_swap(&node, "in", &pod);
    assert!(!ok, "three refusals in a row: {answer}");
    assert!(answer.contains("500"), "{answer}");
    let record = pod_swap(&node, &pod);
    assert_eq!(record.state, Residency::Swapped);
    assert!(
        record
            .history
            .last_error
            .as_deref()
            .is_some_and(|e| e.contains("cuCheckpointProcessRestore")),
        "{record:?}"
    );
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
    let record = pod_swap(&node, &pod);
    assert_eq!(record.state, Residency::Resident);
    assert!(record.history.last_error.is_none(), "{record:?}");
}

#[test]
fn a_swapped_pod_whose_process_exits_frees_its_host_memory() {
    let pod = Pod::new("swap-exit");
    let node = start(&pod, "4g");
    let mut running = Running::start(&pod, &node.url(), &[], &["alloc", "mem", "2g", "wait"]);
    running.until_ready();
    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    running.child.kill().expect("kill the probe");
    let _ = running.child.wait();
    eventually("the pod's host memory is given back", || {
        node.hypervisor().swap_status().totals.bytes_on_host == 0
    });
    let record = pod_swap(&node, &pod);
    assert_eq!(record.state, Residency::Resident);
    // A new process of the pod runs at once.
    let lines = probes::run({
        let mut command = probe(
            "cudaprobe",
            &pod,
            &[
                ("CUDA_LIMITER_HYPERVISOR", &node.url()),
                ("CUDA_LIMITER_TOKEN", TOKEN),
            ],
            &["alloc", "mem", "3g"],
        );
        probes::use_node_tables(&mut command, &pod);
        command
    });
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
}

#[test]
fn a_restarted_daemon_finds_the_swapped_pod_and_brings_it_back() {
    let pod = Pod::new("swap-restart");
    let node = start(&pod, "4g");
    let mut running = Running::start(
        &pod,
        &node.url(),
        &[],
        &[
            "alloc", "mem", "2g", "wait", "alloc", "mem", "1g", "alloc", "mem", "2g",
        ],
    );
    running.until_ready();
    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    let addr = node.addr();
    node.stop();
    // The same config on the same port: the probe's limiter reaches it.
    let text = config(&pod, "4g", "").replace("127.0.0.1:0", &addr.to_string());
    let again = daemon::hypervisor(&pod, &text, Arc::new(double_gpus(1)));
    eventually("the new daemon shows the pod swapped", || {
        pod_swap(&again, &pod).state == Residency::Swapped
    });
    assert_eq!(control_block(running.pid()).state, 2, "still checkpointed");
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
    assert!(
        rest[2].contains("-> 2 "),
        "the quota holds after the restart: {rest:?}"
    );
    assert_eq!(pod_swap(&again, &pod).state, Residency::Resident);
}

/// A daemon of two pods (each with its quota) on one 16 GiB GPU that their
/// processes share (the double's node file), the first's probe running its
/// script up to its `wait` (its first line a success), then, once it is
/// idle, the second's: the node, both probes, and the second's lines.
fn one_gpu_then_another(
    first: (&Pod, &str, &[&str]),
    second: (&Pod, &str, &[&str]),
) -> (RunningNode, Running, Running, Vec<String>) {
    let node_file = checkpoint_dir().join(format!("{}.node", second.0.0));
    let node = overcommitted(
        &node_file,
        1,
        &[(first.0, 0, first.1), (second.0, 0, second.1)],
    );
    let shared = [(
        gpushare_examples::NODE_FILE_VAR,
        node_file.to_str().expect("a path"),
    )];
    let mut a = Running::start(first.0, &node.url(), &shared, first.2);
    let lines = a.until_ready();
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    std::thread::sleep(Duration::from_millis(400));
    let mut b = Running::start(second.0, &node.url(), &shared, second.2);
    let lines = b.until_ready();
    (node, a, b, lines)
}

#[test]
fn pods_that_need_memory_the_gpu_lacks_take_it_from_idle_ones() {
    // Two pods of 10 GiB quotas on one 16 GiB GPU that their processes
    // share (the double's node file): each fits only while the other is
    // in host memory.
    let first = Pod::new("swap-room-a");
    let second = Pod::new("swap-room-b");
    // The first idles past idle_after_ms; then the second pod's 8 GiB does
    // not fit beside the first's 9 and more, until the first is swapped out.
    let (node, mut a, mut b, lines) = one_gpu_then_another(
        (
            &first,
            "10g",
            &["alloc", "mem", "9g", "wait", "alloc", "mem", "256m"],
        ),
        (&second, "10g", &["alloc", "mem", "8g", "wait", "info"]),
    );
    assert!(lines[0].contains("-> 0 "), "room was made: {lines:?}");
    assert_eq!(
        control_block(a.pid()).state,
        2,
        "the idle pod is in host memory"
    );
    assert_eq!(pod_swap(&node, &first).state, Residency::Swapped);
    assert_eq!(pod_swap(&node, &second).state, Residency::Resident);

    // The first pod's next call brings it back, making room in turn: the
    // second pod, idle now, goes to host memory.
    std::thread::sleep(Duration::from_millis(400));
    a.resume();
    let (rest, status) = a.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
    assert_eq!(control_block(b.pid()).state, 2, "the second pod made room");
    let record = pod_swap(&node, &first);
    assert_eq!(
        (record.history.swap_outs, record.history.swap_ins),
        (1, 1),
        "{record:?}"
    );

    // The first pod's process is gone: the second comes back at its call.
    b.resume();
    let (rest, status) = b.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].starts_with("info 0 "), "{rest:?}");
    assert_eq!(pod_swap(&node, &second).state, Residency::Resident);
    assert_eq!(node.hypervisor().swap_status().totals.failures, 0);
}

#[test]
fn a_process_whose_context_finds_no_room_has_an_idle_pod_swapped_out_for_it() {
    // The first pod leaves less free on the 16 GiB GPU than a context
    // takes (300 MiB on the double); the second pod's process, starting,
    // cannot create its context until the first, idle, is swapped out.
    let first = Pod::new("swap-ctx-a");
    let second = Pod::new("swap-ctx-b");
    let (node, mut a, mut b, lines) = one_gpu_then_another(
        (
            &first,
            "16g",
            &["alloc", "mem", "15872m", "wait", "alloc", "mem", "64m"],
        ),
        (&second, "2g", &["alloc", "mem", "64m", "wait", "info"]),
    );
    assert!(
        lines[0].contains("-> 0 "),
        "its context, then its allocation: {lines:?}"
    );
    assert_eq!(control_block(a.pid()).state, 2, "the idle pod made room");
    assert_eq!(pod_swap(&node, &first).state, Residency::Swapped);

    // Each comes back at its next call, the other idle by then.
    b.resume();
    let (rest, status) = b.finish();
    assert!(status.success(), "{rest:?}");
    std::thread::sleep(Duration::from_millis(400));
    a.resume();
    let (rest, status) = a.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
}

#[test]
fn a_pod_that_cannot_come_back_for_want_of_room_waits_until_there_is_room() {
    // Two pods of 10 GiB quotas on one 16 GiB GPU; host memory for swapped
    // pods (12 GiB) takes one of them, not both: once the first is away,
    // the second cannot go out to make room for its return.
    let first = Pod::new("swap-wait-a");
    let second = Pod::new("swap-wait-b");
    let node_file = checkpoint_dir().join(format!("{}.node", second.0));
    let node = overcommitted_within(
        &node_file,
        1,
        &[(&first, 0, "10g"), (&second, 0, "10g")],
        "12g",
    );
    let shared = on_gpu(&node_file, 1, 0);
    let shared = env(&shared);
    let mut a = Running::start(
        &first,
        &node.url(),
        &shared,
        &["alloc", "mem", "9g", "wait", "alloc", "mem", "256m"],
    );
    assert!(a.until_ready()[0].contains("-> 0 "));
    let (ok, answer) = cli_swap(&node, "out", &first);
    assert!(ok, "{answer}");
    let mut b = Running::start(
        &second,
        &node.url(),
        &shared,
        &["alloc", "mem", "8g", "wait"],
    );
    assert!(b.until_ready()[0].contains("-> 0 "));
    std::thread::sleep(Duration::from_millis(400));

    // The first pod's call asks for it back: the GPU lacks the room and the
    // idle second pod cannot go; the swap-in is refused, not tried.
    // (It asks at once, and again and again while it waits.)
    a.resume();
    std::thread::sleep(Duration::from_secs(2));
    let record = pod_swap(&node, &first);
    assert_eq!(record.state, Residency::Swapped, "{record:?}");
    assert_eq!(
        record.history.failures, 0,
        "no restore tried in vain: {record:?}"
    );
    assert_eq!(control_block(b.pid()).state, 0, "the second pod runs on");

    // The second pod ends: its memory is free, the first comes back.
    ended(b);
    let (rest, status) = a.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "{rest:?}");
    let record = pod_swap(&node, &first);
    assert_eq!(record.state, Residency::Resident, "{record:?}");
    assert_eq!(record.history.failures, 0, "{record:?}");
}

#[test]
fn a_room_request_frees_only_what_the_askers_allocation_lacks_on_its_own_gpu() {
    // Two idle neighbours of 9 GiB, one on each GPU; the asker holds 1 GiB
    // of a 2 GiB quota on the first, which has about 6 GiB free.
    let asker = Pod::new("room-asker");
    let near = Pod::new("room-near");
    let far = Pod::new("room-far");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = overcommitted(
        &node_file,
        2,
        &[(&asker, 0, "2g"), (&near, 0, "10g"), (&far, 1, "10g")],
    );
    let (first, second) = (on_gpu(&node_file, 2, 0), on_gpu(&node_file, 2, 1));
    let mut neighbours = Vec::new();
    for (pod, vars) in [(&near, &first), (&far, &second)] {
        let mut running = Running::start(
            pod,
            &node.url(),
            &env(vars),
            &["alloc", "mem", "9g", "wait"],
        );
        let lines = running.until_ready();
        assert!(lines[0].contains("-> 0 "), "{lines:?}");
        neighbours.push(running);
    }
    let mut running = Running::start(
        &asker,
        &node.url(),
        &env(&first),
        &["alloc", "mem", "1g", "wait"],
    );
    let lines = running.until_ready();
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    std::thread::sleep(Duration::from_millis(400));

    let (gpu0, gpu1) = (gpushare_examples::uuid(0), gpushare_examples::uuid(1));
    // Nothing freed; the answer says whether the GPU has the room, and so
    // whether the asker's allocation is worth trying again.
    for (uuid, bytes, room, why) in [
        (&gpu0, 1, true, "one byte, which the GPU has free"),
        (&gpu1, 8 * GIB, false, "a GPU the asker is not placed on"),
        (
            &gpu0,
            8 * GIB,
            true,
            "more than the asker's quota leaves (1 GiB, free on the GPU)",
        ),
    ] {
        let answer = ask_room(&node, &asker, uuid, bytes);
        assert_eq!((answer.freed, answer.room), (0, room), "{why}");
        for running in &neighbours {
            assert_eq!(
                control_block(running.pid()).state,
                0,
                "{why}: a neighbour swapped"
            );
        }
    }
    for pod in [&near, &far] {
        assert_eq!(pod_swap(&node, pod).state, Residency::Resident);
    }
    assert_eq!(node.hypervisor().swap_status().totals.swap_outs, 0);

    for running in neighbours.into_iter().chain([running]) {
        let (rest, status) = running.finish();
        assert!(status.success(), "{rest:?}");
    }
}

#[test]
fn room_is_made_for_what_the_askers_driver_lacks_within_what_its_quota_leaves() {
    // Two idle neighbours of 4 GiB and the asker, holding 1 GiB of a 6 GiB
    // quota, on one 16 GiB GPU: about 6 GiB free by NVML, and the asker's
    // quota leaves about 4.7 GiB.
    let asker = Pod::new("room-driver-asker");
    let first = Pod::new("room-driver-a");
    let second = Pod::new("room-driver-b");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = overcommitted(
        &node_file,
        1,
        &[(&asker, 0, "6g"), (&first, 0, "5g"), (&second, 0, "5g")],
    );
    let vars = on_gpu(&node_file, 1, 0);
    let mut running = Vec::new();
    for (pod, size) in [(&first, "4g"), (&second, "4g"), (&asker, "1g")] {
        let mut probe = Running::start(
            pod,
            &node.url(),
            &env(&vars),
            &["alloc", "mem", size, "wait"],
        );
        let lines = probe.until_ready();
        assert!(lines[0].contains("-> 0 "), "{lines:?}");
        running.push(probe);
    }
    std::thread::sleep(Duration::from_millis(400));
    let gpu = gpushare_examples::uuid(0);

    // 4 GiB, which NVML shows free, but the asker's driver had only 3.5:
    // NVML counts as free what the driver keeps, so one neighbour goes.
    let answer = ask_room_saying(&node, &asker, &gpu, 4 * GIB, Some(7 * GIB / 2));
    assert!(answer.freed > 0 && answer.room, "{answer:?}");
    assert_eq!(node.hypervisor().swap_status().totals.swap_outs, 1);

    // A driver said to have nothing free, again and again: the room made
    // on its word stays within what the asker's quota leaves, already
    // free now, so the other neighbour stays.
    for _ in 0..2 {
        let answer = ask_room_saying(&node, &asker, &gpu, 4 * GIB, Some(0));
        assert_eq!((answer.freed, answer.room), (0, true), "{answer:?}");
    }
    assert_eq!(node.hypervisor().swap_status().totals.swap_outs, 1);
    let states: Vec<Residency> = [&first, &second]
        .iter()
        .map(|pod| pod_swap(&node, pod).state)
        .collect();
    assert!(
        states.contains(&Residency::Resident) && states.contains(&Residency::Swapped),
        "{states:?}"
    );
    for probe in running {
        let (rest, status) = probe.finish();
        assert!(status.success(), "{rest:?}");
    }
}

#[test]
fn a_pod_whose_last_call_is_stamped_in_the_future_is_idle() {
    let pod = Pod::new("swap-future");
    let node = start(&pod, "4g");
    let mut running = Running::start(
        &pod,
        &node.url(),
        &[],
        &["alloc", "mem", "1g", "wait", "alloc", "mem", "1g"],
    );
    running.until_ready();
    // The pod writes its own ledger: an hour ahead of the clock.
    let ledger = gpushare_utils::ledger::PodLedger::open(&pod.0).expect("the pod's ledger");
    ledger.touch(gpushare_utils::clock::monotonic_ms() + 3_600_000);

    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"residency\":\"swapped\""), "{answer}");
    assert_eq!(control_block(running.pid()).state, 2);
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("-> 0 "), "back, with its quota: {rest:?}");
}

#[test]
fn when_an_idle_pod_cannot_make_room_the_next_one_does() {
    // The least recently used pod holds managed memory, which the driver
    // cannot checkpoint; the next one can go.
    let asker = Pod::new("room-next-asker");
    let stuck = Pod::new("room-next-stuck");
    let next = Pod::new("room-next-next");
    let node_file = checkpoint_dir().join(format!("{}.node", asker.0));
    let node = overcommitted(
        &node_file,
        1,
        &[(&asker, 0, "10g"), (&stuck, 0, "10g"), (&next, 0, "10g")],
    );
    let shared = on_gpu(&node_file, 1, 0);
    let mut stuck_probe = Running::start(
        &stuck,
        &node.url(),
        &env(&shared),
        &["alloc", "managed", "1g", "alloc", "mem", "6g", "wait"],
    );
    let lines = stuck_probe.until_ready();
    assert!(lines[..2].iter().all(|l| l.contains("-> 0 ")), "{lines:?}");
    std::thread::sleep(Duration::from_millis(50));
    let mut next_probe = Running::start(
        &next,
        &node.url(),
        &env(&shared),
        &["alloc", "mem", "6g", "wait"],
    );
    let lines = next_probe.until_ready();
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    std::thread::sleep(Duration::from_millis(400));

    // 6 GiB does not fit beside the 13 GiB held until one pod is away.
    let mut asking = Running::start(
        &asker,
        &node.url(),
        &env(&shared),
        &["alloc", "mem", "6g", "wait"],
    );
    let lines = asking.until_ready();
    assert!(lines[0].contains("-> 0 "), "room was made: {lines:?}");
    assert_eq!(
        control_block(next_probe.pid()).state,
        2,
        "the next pod went"
    );
    assert_eq!(
        control_block(stuck_probe.pid()).state,
        0,
        "the first runs on"
    );
    let record = pod_swap(&node, &stuck);
    assert_eq!(record.state, Residency::Resident);
    assert!(record.history.last_error.is_some(), "{record:?}");
    for running in [asking, stuck_probe, next_probe] {
        let (rest, status) = running.finish();
        assert!(status.success(), "{rest:?}");
    }
}

/// A daemon of the pods `pods` (4 GiB each on GPU 0, [`TOKEN`]), `extra_swap`
/// added to its `[swap]` table, seeing the GPUs through `observer`.
fn start_pods(
    pods: &[&Pod],
    extra_swap: &str,
    observer: Arc<dyn hypervisor_observer::GpuObserver>,
) -> RunningNode {
    let mut text = config(pods[0], "4g", extra_swap);
    for pod in &pods[1..] {
        text.push_str(&format!(
            "\n[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"4g\"\n",
            pod.0
        ));
    }
    daemon::hypervisor(pods[0], &text, observer)
}

/// A probe of `pod` that holds `size` on the GPU and waits.
fn holding(pod: &Pod, node: &RunningNode, size: &str) -> Running {
    let mut running = Running::start(pod, &node.url(), &[], &["alloc", "mem", size, "wait"]);
    let lines = running.until_ready();
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    running
}

/// Lets a [`holding`] probe end, and checks that it did.
fn ended(mut running: Running) {
    running.resume();
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
}

#[test]
fn a_pod_that_names_a_neighbours_process_cannot_have_it_swapped() {
    let pod = Pod::new("swap-forger");
    let neighbour = Pod::new("swap-neighbour");
    let node = start_pods(&[&pod, &neighbour], "", Arc::new(double_gpus(1)));
    let own = holding(&pod, &node, "1g");
    let other = holding(&neighbour, &node, "1g");
    let victim = other.pid();
    let held = control_block(victim).device_bytes;

    // With nothing but its own token, the pod names the neighbour's process
    // as a worker it registers, as an earlier run's worker that the daemon
    // adopts by its id, and in a slot of its own ledger.
    let (registered, refusal) = post(
        &node,
        "/workers",
        TOKEN,
        &format!(r#"{{"pod":"{}","pid":{victim}}}"#, pod.0),
    );
    let (adopted, _) = post(
        &node,
        "/admission",
        TOKEN,
        &format!(
            r#"{{"worker_id":"{}-{victim}-1","uuid":"{}","cost_ns":1}}"#,
            pod.0,
            gpushare_examples::uuid(0)
        ),
    );
    assert_eq!(adopted, 200, "a worker id of an earlier run is adopted");
    name_in_ledger(&pod, victim);

    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    assert_eq!(
        control_block(own.pid()).state,
        2,
        "the pod's own process is swapped"
    );
    let block = control_block(victim);
    assert_eq!(
        (block.state, block.device_bytes, block.host_bytes),
        (0, held, 0),
        "the neighbour's process runs on with all its memory on the GPU"
    );
    assert_eq!(pod_swap(&node, &neighbour).state, Residency::Resident);
    assert_eq!(registered, 403, "another pod's process: {refusal}");
    assert!(refusal.contains("another pod's"), "{refusal}");
    ended(other);
    ended(own);
}

#[test]
fn pid_1_named_by_a_pod_blocks_none_of_its_swaps() {
    let pod = Pod::new("swap-pid1");
    let node = start(&pod, "4g");
    let running = holding(&pod, &node, "1g");
    // Pid 1 as a registered worker, an adopted one and a ledger slot.
    let (registered, answer) = post(
        &node,
        "/workers",
        TOKEN,
        &format!(r#"{{"pod":"{}","pid":1}}"#, pod.0),
    );
    assert_eq!(registered, 200, "{answer}");
    let (adopted, _) = post(
        &node,
        "/admission",
        TOKEN,
        &format!(
            r#"{{"worker_id":"{}-1-1","uuid":"{}","cost_ns":1}}"#,
            pod.0,
            gpushare_examples::uuid(0)
        ),
    );
    assert_eq!(adopted, 200);
    name_in_ledger(&pod, 1);

    let (ok, answer) = cli_swap(&node, "out", &pod);
    assert!(ok, "{answer}");
    assert_eq!(control_block(running.pid()).state, 2);
    let (ok, answer) = cli_swap(&node, "in", &pod);
    assert!(ok, "{answer}");
    assert_eq!(control_block(running.pid()).state, 0);
    ended(running);
}

#[test]
fn host_memory_is_counted_by_what_the_processes_hold_not_by_their_ledger() {
    // Each process holds 2 GiB and more (its context); host memory takes
    // one such pod, not two. Both ledgers say they hold 1 byte.
    let first = Pod::new("swap-under-a");
    let second = Pod::new("swap-under-b");
    let node = start_pods(
        &[&first, &second],
        "host_limit = \"3g\"",
        Arc::new(process_gpus(1)),
    );
    let a = holding(&first, &node, "2g");
    let b = holding(&second, &node, "2g");
    for pod in [&first, &second] {
        write_ledger_usage(pod, &gpushare_examples::uuid(0), 1);
    }

    let (ok, answer) = cli_swap(&node, "out", &first);
    assert!(ok, "{answer}");
    let moved = control_block(a.pid()).host_bytes;
    assert!(moved > 2 * GIB, "{moved}");
    assert_eq!(
        pod_swap(&node, &first).history.bytes_on_host,
        moved,
        "counted as what went to host memory"
    );
    let (ok, answer) = cli_swap(&node, "out", &second);
    assert!(!ok, "past the host limit: {answer}");
    assert!(
        answer.contains("host memory for swapped pods is full"),
        "{answer}"
    );
    let block = control_block(b.pid());
    assert_eq!((block.state, block.host_bytes), (0, 0), "it runs on");
    assert!(node.hypervisor().swap_status().totals.bytes_on_host <= 3 * GIB);
    ended(a);
    ended(b);
}
