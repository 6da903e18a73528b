//! Swap by the fast path under a real daemon and the driver double: a pod
//! whose every process backs its memory itself (`CUDA_LIMITER_FAST_SWAP`)
//! is swapped out by its processes' limiters, which give the GPU's memory
//! back without the driver's checkpoint, and its next CUDA call brings the
//! same bytes back to the same addresses; the status and the metrics say
//! which path each swap took and the bytes each way. A pod with one
//! process without the setting is swapped by the checkpoint instead, and
//! so is a pod one of whose processes fails its own swap-out (the others
//! bring their memory back first), or whose process holds memory its
//! limiter does not back (the driver's checkpoint takes all of it; the
//! status says why); one whose processes share memory by CUDA IPC stays
//! on its GPU, since the checkpoint could not bring it back. The
//! host copies a pod's processes keep after a fast swap-in count against
//! `host_limit` (until the processes leave), and are given back when
//! another pod's swap-out needs the room. The idle pod that goes next (on
//! an overcommitting GPU to make room, on any other by hand) has its
//! copies prepared ahead, within `prepare_ahead`, while it stays on the
//! GPU, and room is made first by an idle pod whose copies are ready (its
//! swap-out only copies); a pod brought back that keeps its copies goes
//! again, ahead of need or for another's room, once it may (within
//! moments), rather than give them back for another pod's or leave the
//! room to a pod that pins; but ahead of need a popular pod (used twice
//! since a colder pod's last call) stays, and the colder one has its
//! copies made and goes. An allocation the GPU has room for only once
//! another pod goes is backed all the same.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use gpushare_utils::limits::Residency;
use hypervisor_swap::SwapPath;
use system_tests::daemon::{node_file_gpus, process_gpus, with_process_memory};
use system_tests::pod::Pod;
use system_tests::probes::{CONTEXT_BYTES, GIB, MIB};
use system_tests::swapping::{ADMIN, Running, TOKEN, admin_cli, checkpoint_dir, control_block};
use system_tests::wait::eventually;
use system_tests::{RunningNode, daemon};

/// What each probe allocates (backed, with the setting) and writes.
const HELD: u64 = 64 * MIB;

/// Allocates and writes, waits, then checks the bytes: a copy, which the
/// limiter holds while the pod is away.
const SCRIPT: &[&str] = &[
    "alloc", "mem", "64m", "write", "0", "9", "wait", "check", "0", "9",
];

/// A daemon of one double GPU, whose NVML shows what each process holds.
fn start(pod: &Pod) -> RunningNode {
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let config = format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"4g\"\n",
        library.display(),
        pod.0
    );
    daemon::hypervisor(pod, &config, Arc::new(process_gpus(1)))
}

/// A probe of `pod` running [`SCRIPT`], with the setting or without, up to
/// its `wait`: the address its memory is at.
fn ready(pod: &Pod, node: &RunningNode, fast: bool) -> (Running, String) {
    let env: &[(&str, &str)] = if fast {
        &[("CUDA_LIMITER_FAST_SWAP", "1")]
    } else {
        &[]
    };
    ready_with(pod, node, env)
}

fn ready_with(pod: &Pod, node: &RunningNode, env: &[(&str, &str)]) -> (Running, String) {
    let mut running = Running::start(pod, &node.url(), env, SCRIPT);
    let lines = running.until_ready();
    assert!(lines[1].contains("-> 0 at="), "{lines:?}");
    let at = lines[1].split("at=").nth(1).expect("an address").to_owned();
    (running, at)
}

/// Lets the probe's trapped call go on; its check of the bytes.
fn check_after(running: Running, at: &str) {
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
    assert_eq!(rest[0], "resumed");
    assert!(
        rest[1].starts_with("check 0 9 -> 0 differ=0 at="),
        "the same bytes: {rest:?}"
    );
    assert!(rest[1].ends_with(at), "at the same address: {rest:?}");
}

/// A daemon's config of `pods` with `quota` each on GPU 0 of the double,
/// `swap` added to its `[swap]` table.
fn pods_config(pods: &[&Pod], quota: &str, swap: &str) -> String {
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let pods: String = pods
        .iter()
        .map(|pod| {
            format!(
                "[[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"{quota}\"\n\n",
                pod.0
            )
        })
        .collect();
    format!(
        "listen = \"127.0.0.1:0\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n{swap}\n\n{pods}",
        library.display(),
    )
}

/// A daemon of `pods`, `quota` each, on one 2 GiB double GPU that their
/// processes share (the double's node file, named after the first pod),
/// `swap` added to its `[swap]` table; and that node file.
fn shared_gpu(pods: &[&Pod], quota: &str, swap: &str) -> (RunningNode, PathBuf) {
    let node_file = checkpoint_dir().join(format!("{}.node", pods[0].0));
    let config = pods_config(pods, quota, swap);
    let gpus = with_process_memory(node_file_gpus(node_file.clone(), 2 * GIB, 1));
    (
        daemon::hypervisor(pods[0], &config, Arc::new(gpus)),
        node_file,
    )
}

/// The environment of a probe on [`shared_gpu`]'s GPU, backing its
/// memory itself.
fn shared_env(node_file: &Path) -> [(&'static str, &str); 3] {
    [
        ("CUDA_LIMITER_FAST_SWAP", "1"),
        ("GPUSHARE_DOUBLE_TOTAL", "2g"),
        (
            gpushare_examples::NODE_FILE_VAR,
            node_file.to_str().expect("a path"),
        ),
    ]
}

/// A probe of `pod` with the setting that allocates 64 MiB its limiter
/// backs and writes it, then makes `other` (an allocation API and a
/// size), registered, at its `wait`: the address of its backed memory.
fn backed_and(pod: &Pod, node: &RunningNode, other: [&str; 2]) -> (Running, String) {
    let script = [
        "alloc", "mem", "64m", "write", "0", "9", "alloc", other[0], other[1], "wait", "check",
        "0", "9",
    ];
    let mut running = Running::start(
        pod,
        &node.url(),
        &[("CUDA_LIMITER_FAST_SWAP", "1")],
        &script,
    );
    let lines = running.until_ready();
    let made = format!("alloc {} {} -> 0", other[0], other[1]);
    assert!(lines[2].starts_with(&made), "{lines:?}");
    let at = lines[1].split("at=").nth(1).expect("an address").to_owned();
    registered(node, pod, 1);
    (running, at)
}

fn registered(node: &RunningNode, pod: &Pod, count: usize) {
    eventually("the pod's processes are registered", || {
        node.hypervisor().workers_of(&pod.0).len() == count
    });
}

#[test]
fn a_pod_whose_processes_all_back_their_memory_swaps_by_the_fast_path() {
    let pod = Pod::new("fast-swap");
    let node = start(&pod);
    let (first, first_at) = ready(&pod, &node, true);
    let (second, second_at) = ready(&pod, &node, true);
    registered(&node, &pod, 2);
    let held: Vec<u64> = [&first, &second]
        .iter()
        .map(|r| control_block(r.pid()).device_bytes)
        .collect();

    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    assert!(answer.contains("\"residency\":\"swapped\""), "{answer}");
    for (running, before) in [&first, &second].iter().zip(&held) {
        let block = control_block(running.pid());
        assert_eq!(block.state, 0, "not checkpointed: {block:?}");
        assert_eq!(
            block.device_bytes,
            before - HELD,
            "its backed memory given back to the GPU"
        );
    }
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Swapped);
    let history = &record.history;
    assert_eq!(
        history.last_swap_out_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );
    assert_eq!(history.last_bytes_out, 2 * HELD, "{record:?}");
    assert_eq!(history.bytes_on_host, 2 * HELD, "{record:?}");
    let metrics = daemon::metrics(&node.url());
    assert!(
        metrics.contains("gpushare_swaps_total{direction=\"out\",path=\"fast\"} 1"),
        "{metrics}"
    );

    // The first call of either brings the pod back, both processes' memory.
    check_after(first, &first_at);
    check_after(second, &second_at);
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Resident);
    let history = &record.history;
    assert_eq!(
        history.last_swap_in_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );
    assert_eq!(history.last_bytes_in, 2 * HELD, "{record:?}");
    assert_eq!((history.swap_outs, history.swap_ins), (1, 1), "{record:?}");
    let metrics = daemon::metrics(&node.url());
    assert!(
        metrics.contains(&format!(
            "gpushare_swap_bytes_total{{direction=\"in\"}} {}",
            2 * HELD
        )),
        "{metrics}"
    );
}

#[test]
fn a_restarted_daemon_adopts_a_fast_pods_process_and_swaps_it_by_the_fast_path() {
    let pod = Pod::new("fast-adopted");
    let node = start(&pod);
    let (running, at) = ready(&pod, &node, true);
    registered(&node, &pod, 1);
    // The same config on the same port: the probe's limiter reaches it.
    let addr = node.addr();
    node.stop();
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let config = format!(
        "listen = \"{addr}\"\nadmin_token = \"{ADMIN}\"\n\n[swap]\ncuda_library = \"{}\"\n\n\
         [[pods]]\nid = \"{}\"\ntoken = \"{TOKEN}\"\n\n[[pods.gpus]]\nindex = 0\nmemory = \"4g\"\n",
        library.display(),
        pod.0
    );
    let again = daemon::hypervisor(&pod, &config, Arc::new(process_gpus(1)));
    // Adopted from its next request, its setting from its first answer.
    eventually("the process is adopted with its setting", || {
        again.hypervisor().workers_of(&pod.0).iter().any(|id| {
            again
                .hypervisor()
                .worker(id)
                .is_some_and(|w| w.adopted && w.fast_swap && w.host_pid.is_some())
        })
    });

    let (ok, answer) = admin_cli(&again, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    let record = again.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );
    check_after(running, &at);
}

#[test]
fn a_process_that_does_not_answer_holds_the_nodes_swaps_only_briefly() {
    let pod = Pod::new("fast-silent");
    let node = start(&pod);
    let (running, at) = ready(&pod, &node, true);
    registered(&node, &pod, 1);
    let pid = i32::try_from(running.pid()).expect("a pid");
    // SAFETY: a signal to the test's own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    // Its swap-out and the swap-in that would undo it each wait for its
    // size (10 s and a second a GiB: about 21 s in all here), not two
    // minutes each.
    let started = std::time::Instant::now();
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    let took = started.elapsed();
    assert!(!ok, "{answer}");
    assert!(
        took < std::time::Duration::from_secs(60),
        "{took:?}: {answer}"
    );
    // Running again, it answers what it was sent and its next call finds
    // its memory as it was.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    check_after(running, &at);
}

#[test]
fn a_pod_with_a_process_without_the_setting_swaps_by_the_checkpoint() {
    let pod = Pod::new("fast-mixed");
    let node = start(&pod);
    let (fast, fast_at) = ready(&pod, &node, true);
    let (plain, _) = ready(&pod, &node, false);
    registered(&node, &pod, 2);

    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    for running in [&fast, &plain] {
        let block = control_block(running.pid());
        assert_eq!(
            (block.state, block.device_bytes),
            (2, 0),
            "checkpointed: {block:?}"
        );
    }
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Checkpoint),
        "{record:?}"
    );

    check_after(fast, &fast_at);
    let (rest, status) = plain.finish();
    assert!(status.success(), "{rest:?}");
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Resident);
    assert_eq!(
        record.history.last_swap_in_path,
        Some(SwapPath::Checkpoint),
        "{record:?}"
    );
}

#[test]
fn a_pod_sharing_backed_memory_by_cuda_ipc_stays_on_its_gpu_and_says_why() {
    shared_pod_stays("fast-ipc", false);
}

#[test]
fn a_pod_sharing_memory_by_cuda_ipc_is_not_checkpointed_either() {
    // A third process without the setting sends the pod straight to the
    // checkpoint, which asks the processes first.
    shared_pod_stays("fast-ipc-mixed", true);
}

#[test]
fn a_pod_sharing_memory_by_cuda_ipc_is_passed_over_when_room_is_made() {
    // Two pods on a 2 GiB GPU: the idle one, whose process shares its
    // memory, is the only one that could make room for the other's
    // allocations; it is asked at most once, not once an allocation.
    let (sharing, asking) = (Pod::new("fast-ipc-room"), Pod::new("fast-ipc-asker"));
    let swap = "overcommit = true\nidle_after_ms = 200\nroom_wait_ms = 300\nhost_limit = \"64g\"";
    let (node, node_file) = shared_gpu(&[&sharing, &asking], "1536m", swap);
    let env = shared_env(&node_file);
    let script = ["alloc", "mem", "768m", "ipc-export", "0", "wait"];
    let mut running = Running::start(&sharing, &node.url(), &env, &script);
    let lines = running.until_ready();
    assert!(lines[1].starts_with("ipc-export 0 -> 0 "), "{lines:?}");
    registered(&node, &sharing, 1);
    std::thread::sleep(std::time::Duration::from_millis(400));

    let script = [
        "alloc", "mem", "1g", "alloc", "mem", "1g", "alloc", "mem", "1g", "alloc", "mem", "1g",
    ];
    let (lines, status) = Running::start(&asking, &node.url(), &env, &script).finish();
    assert!(status.success(), "{lines:?}");
    assert!(
        lines.iter().all(|l| l.contains("-> 2 ")),
        "no room to be had: {lines:?}"
    );
    let record = node.hypervisor().pod_swap(&sharing.0);
    assert_eq!(record.state, Residency::Resident, "{record:?}");
    assert!(
        record.history.failures <= 1,
        "asked at most once: {record:?}"
    );
    let (rest, status) = running.finish();
    assert!(status.success(), "{rest:?}");
}

/// Two processes of a pod sharing backed memory by CUDA IPC (and a third
/// without the setting where `plain`): a swap-out is refused, the memory
/// stays where it was.
fn shared_pod_stays(name: &str, plain: bool) {
    let pod = Pod::new(name);
    let node = start(&pod);
    let fast = [("CUDA_LIMITER_FAST_SWAP", "1")];
    let exporter_script = [
        "alloc",
        "mem",
        "64m",
        "write",
        "0",
        "9",
        "ipc-export",
        "0",
        "wait",
        "check",
        "0",
        "9",
    ];
    let mut exporter = Running::start(&pod, &node.url(), &fast, &exporter_script);
    let lines = exporter.until_ready();
    assert!(lines[2].starts_with("ipc-export 0 -> 0 "), "{lines:?}");
    let handle = lines[2].split("handle=").nth(1).expect("a handle");
    // Another process of the pod maps the same bytes and holds them.
    let importer_script = [
        "ipc-open",
        handle,
        "wait",
        "check",
        "0",
        "9",
        "ipc-close",
        "0",
    ];
    let mut importer = Running::start(&pod, &node.url(), &fast, &importer_script);
    let imported = importer.until_ready();
    assert!(imported[0].starts_with("ipc-open -> 0 "), "{imported:?}");
    let other = plain.then(|| ready(&pod, &node, false).0);
    registered(&node, &pod, if plain { 3 } else { 2 });

    // The driver's checkpoint would take the importer and never give it
    // back: the swap is refused, both processes' memory where it was.
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(!ok && answer.contains("CUDA IPC"), "{answer}");
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Resident, "{record:?}");
    assert_eq!(record.history.last_swap_out_path, None, "{record:?}");
    let why = record.history.last_error.as_deref().unwrap_or_default();
    assert!(why.contains("CUDA IPC"), "{record:?}");

    for running in [importer, exporter] {
        let (rest, status) = running.finish();
        assert!(status.success(), "{rest:?}");
        assert!(
            rest[1].starts_with("check 0 9 -> 0 differ=0"),
            "the same bytes: {rest:?}"
        );
    }
    if let Some(other) = other {
        let (rest, status) = other.finish();
        assert!(status.success(), "{rest:?}");
    }
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Resident);
}

#[test]
fn a_process_failing_its_own_swap_out_sends_the_pod_to_the_checkpoint() {
    let pod = Pod::new("fast-fails");
    let node = start(&pod);
    let (good, good_at) = ready(&pod, &node, true);
    // Its swap-out fails at its first unmap, and undoes itself.
    let failing = [
        ("CUDA_LIMITER_FAST_SWAP", "1"),
        ("GPUSHARE_DOUBLE_FAIL_VMM", "cuMemUnmap@1"),
    ];
    let (bad, bad_at) = ready_with(&pod, &node, &failing);
    registered(&node, &pod, 2);

    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "the checkpoint took over: {answer}");
    for running in [&good, &bad] {
        let block = control_block(running.pid());
        assert_eq!(
            (block.state, block.device_bytes),
            (2, 0),
            "all of it checkpointed, the fast part brought back first: {block:?}"
        );
    }
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Checkpoint),
        "{record:?}"
    );
    assert_eq!(record.history.failures, 1, "the fast try: {record:?}");
    let declined = record.history.fast_declined.as_deref().unwrap_or_default();
    assert!(declined.contains("unmapping"), "{record:?}");

    check_after(good, &good_at);
    check_after(bad, &bad_at);
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Resident);
}

#[test]
fn host_copies_a_resident_pod_keeps_are_given_back_when_another_pods_swap_needs_the_room() {
    let (kept, other) = (Pod::new("fast-kept"), Pod::new("fast-room"));
    // Room in host memory for one pod's swap-out, not two: a swap-out asks
    // for what the pod holds on the GPU (its context too), and puts there
    // what its processes back.
    let swap = format!("host_limit = \"{}\"", CONTEXT_BYTES + HELD * 3 / 2);
    let config = pods_config(&[&kept, &other], "4g", &swap);
    let node = daemon::hypervisor(&kept, &config, Arc::new(process_gpus(1)));
    let (first, first_at) = ready(&kept, &node, true);
    let (second, second_at) = ready(&other, &node, true);
    registered(&node, &kept, 1);
    registered(&node, &other, 1);

    // Out and back: the first pod's process keeps its copy, pinned.
    for direction in ["out", "in"] {
        let (ok, answer) = admin_cli(&node, &["swap", direction, &kept.0]);
        assert!(ok, "{answer}");
    }
    let record = node.hypervisor().pod_swap(&kept.0);
    assert_eq!(record.state, Residency::Resident);
    assert_eq!(record.history.host_kept_bytes, HELD, "{record:?}");
    let metrics = daemon::metrics(&node.url());
    assert!(
        metrics.contains(&format!("gpushare_swap_host_kept_bytes {HELD}")),
        "{metrics}"
    );

    // The second pod's swap-out fits only once that copy is given back.
    let (ok, answer) = admin_cli(&node, &["swap", "out", &other.0]);
    assert!(ok, "{answer}");
    let record = node.hypervisor().pod_swap(&kept.0);
    assert_eq!(record.history.host_kept_bytes, 0, "{record:?}");
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (status.totals.bytes_on_host, status.totals.host_kept_bytes),
        (HELD, 0),
        "{status:?}"
    );

    // The first pod, its copy gone, swaps out again by pinning a new one;
    // with the second pod's bytes on the host, it does not fit.
    let (ok, answer) = admin_cli(&node, &["swap", "out", &kept.0]);
    assert!(!ok, "{answer}");
    assert!(
        answer.contains("host memory for swapped pods is full"),
        "{answer}"
    );
    check_after(second, &second_at);
    check_after(first, &first_at);
}

#[test]
fn the_idle_pod_that_goes_next_has_its_host_copies_prepared_ahead_within_its_budget() {
    let (first, second) = (Pod::new("fast-prep-a"), Pod::new("fast-prep-b"));
    // Room among the copies prepared ahead for one pod's, not two (a pod
    // counts for what it holds on the GPU, its context too, until its
    // processes answer).
    let swap = format!(
        "overcommit = true\nidle_after_ms = 200\nhost_limit = \"64g\"\nprepare_ahead = \"{}\"",
        CONTEXT_BYTES + HELD * 3 / 2
    );
    let config = pods_config(&[&first, &second], "1g", &swap);
    let node = daemon::hypervisor(&first, &config, Arc::new(process_gpus(1)));
    let (a, a_at) = ready(&first, &node, true);
    let (b, b_at) = ready(&second, &node, true);
    registered(&node, &first, 1);
    registered(&node, &second, 1);

    eventually("an idle pod's host copies are prepared", || {
        node.hypervisor().swap_status().totals.host_prepares > 0
    });
    // No room is left for the other's, however long it idles.
    std::thread::sleep(std::time::Duration::from_millis(2_500));
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (
            status.totals.host_prepares,
            status.totals.host_prepared_bytes,
            status.totals.host_kept_bytes,
            status.totals.bytes_on_host
        ),
        (1, HELD, HELD, 0),
        "{status:?}"
    );
    let kept = |pod: &Pod| node.hypervisor().pod_swap(&pod.0).history.host_kept_bytes;
    let prepared = if kept(&first) == HELD {
        &first
    } else {
        &second
    };
    assert_eq!(kept(&first) + kept(&second), HELD, "{status:?}");
    for pod in [&first, &second] {
        let record = node.hypervisor().pod_swap(&pod.0);
        assert_eq!(record.state, Residency::Resident, "{record:?}");
    }
    let metrics = daemon::metrics(&node.url());
    assert!(
        metrics.contains("gpushare_swap_host_prepares_total 1"),
        "{metrics}"
    );

    // Its swap-out fits the cap: its own copies hold its bytes.
    let (ok, answer) = admin_cli(&node, &["swap", "out", &prepared.0]);
    assert!(ok, "{answer}");
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (status.totals.bytes_on_host, status.totals.host_kept_bytes),
        (HELD, 0),
        "{status:?}"
    );
    check_after(b, &b_at);
    check_after(a, &a_at);
}

#[test]
fn an_idle_pod_on_a_gpu_that_does_not_overcommit_has_its_copies_prepared_for_a_swap_out_by_hand() {
    let pod = Pod::new("fast-prep-hand");
    let swap =
        "overcommit = false\nidle_after_ms = 200\nhost_limit = \"64g\"\nprepare_ahead = \"1g\"";
    let config = pods_config(&[&pod], "1g", swap);
    let node = daemon::hypervisor(&pod, &config, Arc::new(process_gpus(1)));
    let (running, at) = ready(&pod, &node, true);
    registered(&node, &pod, 1);
    let kept = || node.hypervisor().pod_swap(&pod.0).history.host_kept_bytes;
    eventually("the idle pod's copies are prepared", || {
        node.hypervisor().swap_status().totals.host_prepares == 1 && kept() == HELD
    });
    assert_eq!(
        node.hypervisor().pod_swap(&pod.0).state,
        Residency::Resident
    );

    // The operator's swap-out finds them: its bytes are the copies' bytes,
    // and no other copy is made.
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "{answer}");
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (
            status.totals.bytes_on_host,
            status.totals.host_kept_bytes,
            status.totals.host_prepares,
            status.totals.host_prepared_bytes
        ),
        (HELD, 0, 1, HELD),
        "{status:?}"
    );
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.history.last_swap_out_path, Some(SwapPath::Fast));
    // Back by its next call, it keeps its copies; they go with its process.
    check_after(running, &at);
    eventually("the copies kept go with the process", || {
        node.hypervisor().swap_status().totals.host_kept_bytes == 0
    });
}

#[test]
fn a_prepared_pod_that_grows_is_asked_again_for_the_copies_it_lacks() {
    let (pod, unused) = (Pod::new("fast-prep-grow"), Pod::new("fast-prep-none"));
    let swap =
        "overcommit = true\nidle_after_ms = 200\nhost_limit = \"64g\"\nprepare_ahead = \"8g\"";
    let config = pods_config(&[&pod, &unused], "2g", swap);
    let node = daemon::hypervisor(&pod, &config, Arc::new(process_gpus(1)));
    // Idle at each wait: 64 MiB, then 512 MiB more.
    let script = [
        "alloc", "mem", "64m", "write", "0", "9", "wait", "alloc", "mem", "512m", "wait", "check",
        "0", "9",
    ];
    let env = [("CUDA_LIMITER_FAST_SWAP", "1")];
    let mut running = Running::start(&pod, &node.url(), &env, &script);
    running.until_ready();
    registered(&node, &pod, 1);
    let kept = || node.hypervisor().pod_swap(&pod.0).history.host_kept_bytes;
    eventually("the idle pod's copies are prepared", || kept() == HELD);

    running.resume();
    let lines = running.until_ready();
    assert!(lines[1].starts_with("alloc mem 512m -> 0"), "{lines:?}");
    eventually("the grown pod's new memory gets its copy too", || {
        kept() == HELD + 512 * MIB
    });
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (
            status.totals.host_prepares,
            status.totals.host_prepared_bytes
        ),
        (2, HELD + 512 * MIB),
        "{status:?}"
    );
    let (rest, exit) = running.finish();
    assert!(exit.success(), "{rest:?}");
    assert!(rest[1].contains("differ=0"), "the same bytes: {rest:?}");
}

#[test]
fn a_process_holding_memory_its_limiter_does_not_back_sends_the_pod_to_the_checkpoint() {
    let pod = Pod::new("fast-unbacked");
    let node = start(&pod);
    // Beside its backed memory, 2 GiB it maps with the VMM API itself:
    // the fast path would leave those on the GPU.
    let (running, at) = backed_and(&pod, &node, ["create", "2g"]);

    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(ok, "the checkpoint took over: {answer}");
    let block = control_block(running.pid());
    assert_eq!(
        (block.state, block.device_bytes),
        (2, 0),
        "all of it checkpointed: {block:?}"
    );
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Checkpoint),
        "{record:?}"
    );
    let declined = record.history.fast_declined.as_deref().unwrap_or_default();
    assert!(declined.contains("does not back"), "{record:?}");
    check_after(running, &at);
}

#[test]
fn a_process_holding_managed_memory_sends_the_pod_to_the_checkpoint_and_runs_on_where_it_refuses() {
    let pod = Pod::new("fast-managed");
    let node = start(&pod);
    // Beside its backed memory, 64 MiB of managed memory, which NVML does
    // not show; the double's checkpoint refuses a process holding any.
    let (running, at) = backed_and(&pod, &node, ["managed", "64m"]);
    let held = control_block(running.pid()).device_bytes;

    let (ok, answer) = admin_cli(&node, &["swap", "out", &pod.0]);
    assert!(!ok, "the checkpoint refused: {answer}");
    let block = control_block(running.pid());
    assert_eq!(
        (block.state, block.device_bytes),
        (0, held),
        "running, with all it held: {block:?}"
    );
    let record = node.hypervisor().pod_swap(&pod.0);
    assert_eq!(record.state, Residency::Resident, "{record:?}");
    let declined = record.history.fast_declined.as_deref().unwrap_or_default();
    assert!(
        declined.contains("67108864 bytes of managed memory"),
        "{record:?}"
    );
    assert!(record.history.last_error.is_some(), "{record:?}");
    assert_eq!(record.history.swap_outs, 0, "{record:?}");
    let worker = &node.hypervisor().workers_of(&pod.0)[0];
    assert_eq!(
        node.hypervisor()
            .worker(worker)
            .and_then(|w| w.last_result)
            .map(|r| r.managed_bytes),
        Some(64 * MIB),
        "its answers say what it holds"
    );
    check_after(running, &at);
}

#[test]
fn room_on_an_overcommitting_gpu_is_made_by_the_fast_path() {
    // Two pods of 1.5 GiB quotas on one 2 GiB GPU that their processes share
    // (the double's node file), both backing their memory: the second's
    // allocation fits only once the first, idle, is swapped out, by its
    // own limiter.
    let (idle, asker) = (Pod::new("fast-oc-idle"), Pod::new("fast-oc-asker"));
    let swap = "overcommit = true\nidle_after_ms = 200\nhost_limit = \"64g\"";
    let (node, node_file) = shared_gpu(&[&idle, &asker], "1536m", swap);
    let env = [&shared_env(&node_file)[..], &[("CUDA_LIMITER_LOG", "info")]].concat();
    let mut first = Running::start(
        &idle,
        &node.url(),
        &env,
        &[
            "alloc", "mem", "768m", "write", "0", "7", "wait", "check", "0", "7",
        ],
    );
    let lines = first.until_ready();
    assert!(lines[0].contains("-> 0 "), "{lines:?}");
    registered(&node, &idle, 1);
    std::thread::sleep(std::time::Duration::from_millis(400));

    let mut second = Running::start(&asker, &node.url(), &env, &["alloc", "mem", "768m", "wait"]);
    let lines = second.until_ready();
    assert!(lines[0].contains("-> 0 "), "room was made: {lines:?}");
    let record = node.hypervisor().pod_swap(&idle.0);
    assert_eq!(record.state, Residency::Swapped, "{record:?}");
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );

    second.resume();
    let (rest, status) = second.finish();
    assert!(status.success(), "{rest:?}");
    let (rest, status) = first.finish();
    assert!(status.success(), "{rest:?}");
    assert!(rest[1].contains("differ=0"), "the same bytes: {rest:?}");
}

#[test]
fn room_is_made_by_an_idle_pod_whose_host_copies_are_ready_before_the_least_recently_used() {
    // Three pods of 512 MiB on one 2 GiB GPU their processes share: two fit.
    // The least recently used has no host copies; the other keeps those of
    // a fast swap it came back from. The third's allocation takes the one
    // whose swap-out only copies.
    let (cold, copied, asker) = (
        Pod::new("fast-ready-cold"),
        Pod::new("fast-ready-copied"),
        Pod::new("fast-ready-asker"),
    );
    let swap = "overcommit = true\nidle_after_ms = 200\nmin_resident_ms = 0\nhost_limit = \"64g\"";
    let (node, node_file) = shared_gpu(&[&cold, &copied, &asker], "1g", swap);
    let env = shared_env(&node_file);
    let held = ["alloc", "mem", "512m", "write", "0", "7", "wait"];
    let mut first = Running::start(
        &cold,
        &node.url(),
        &env,
        &[&held[..], &["check", "0", "7"]].concat(),
    );
    assert!(first.until_ready()[0].contains("-> 0 "));
    let twice = [&held[..], &["check", "0", "7", "wait", "check", "0", "7"]].concat();
    let mut second = Running::start(&copied, &node.url(), &env, &twice);
    assert!(second.until_ready()[0].contains("-> 0 "));
    registered(&node, &cold, 1);
    registered(&node, &copied, 1);
    // Out by the fast path and back on its next call, keeping its copies:
    // now the more recently used of the two.
    let (ok, answer) = admin_cli(&node, &["swap", "out", &copied.0]);
    assert!(ok, "{answer}");
    second.resume();
    let lines = second.until_ready();
    assert!(lines[1].starts_with("check 0 7 -> 0 differ=0"), "{lines:?}");
    let kept = node
        .hypervisor()
        .pod_swap(&copied.0)
        .history
        .host_kept_bytes;
    assert_eq!(kept, 512 * MIB);
    std::thread::sleep(std::time::Duration::from_millis(400));

    let mut third = Running::start(&asker, &node.url(), &env, &["alloc", "mem", "512m", "wait"]);
    let lines = third.until_ready();
    assert!(lines[0].contains("-> 0 "), "room was made: {lines:?}");
    let state = |pod: &Pod| node.hypervisor().pod_swap(&pod.0).state;
    assert_eq!(
        (state(&copied), state(&cold)),
        (Residency::Swapped, Residency::Resident),
        "the pod with copies went, the least recently used stayed"
    );
    let record = node.hypervisor().pod_swap(&copied.0);
    assert_eq!(record.history.last_bytes_out, 512 * MIB, "{record:?}");

    third.resume();
    let (rest, status) = third.finish();
    assert!(status.success(), "{rest:?}");
    for running in [second, first] {
        let (rest, status) = running.finish();
        assert!(status.success(), "{rest:?}");
        assert!(
            rest.iter().any(|l| l.contains("differ=0")),
            "the same bytes: {rest:?}"
        );
    }
}

#[test]
fn a_pod_swapped_out_ahead_of_need_has_its_host_copies_made_first_outside_the_swap_lock() {
    // One pod on a 2 GiB GPU whose headroom asks for more than it leaves
    // free: once idle, it goes ahead of need. No copies are prepared
    // otherwise (`prepare_ahead` 0): those it has were made for this swap,
    // before it.
    let (pod, unused) = (Pod::new("fast-ahead"), Pod::new("fast-ahead-none"));
    let swap = "overcommit = true\nidle_after_ms = 200\nheadroom = \"1536m\"\nprepare_ahead = 0\nhost_limit = \"64g\"";
    let (node, node_file) = shared_gpu(&[&pod, &unused], "1536m", swap);
    let env = shared_env(&node_file);
    let script = [
        "alloc", "mem", "768m", "write", "0", "3", "wait", "check", "0", "3",
    ];
    let mut running = Running::start(&pod, &node.url(), &env, &script);
    assert!(running.until_ready()[0].contains("-> 0 "));
    registered(&node, &pod, 1);

    eventually("the idle pod goes ahead of need", || {
        node.hypervisor().pod_swap(&pod.0).state == Residency::Swapped
    });
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (
            status.totals.host_prepares,
            status.totals.host_prepared_bytes,
            status.totals.bytes_on_host
        ),
        (1, 768 * MIB, 768 * MIB),
        "{status:?}"
    );
    let (rest, exit) = running.finish();
    assert!(exit.success(), "{rest:?}");
    assert!(rest.iter().any(|l| l.contains("differ=0")), "{rest:?}");
}

/// Two pods, `{prefix}-a` and `-b`, of 512 MiB (and a context each) on a
/// 2 GiB GPU whose headroom one of them must leave, on a host with room
/// for one pod's copies (a pod counts for its context too until its
/// processes answer), each running `script` up to its first `wait`, once
/// one of them went ahead of need: the daemon, and the probes of the pod
/// that went and of the one that stayed.
struct OneWentAhead {
    went: (Pod, Running),
    stayed: (Pod, Running),
    node: RunningNode,
}

fn one_went_ahead(prefix: &str, min_resident_ms: u64, script: &[&str]) -> OneWentAhead {
    let pods = [
        Pod::new(&format!("{prefix}-a")),
        Pod::new(&format!("{prefix}-b")),
    ];
    // Declared before the daemon, so that a failing test stops it first.
    let mut probes = Vec::new();
    let swap = format!(
        "overcommit = true\nidle_after_ms = 200\nmin_resident_ms = {min_resident_ms}\n\
         headroom = \"700m\"\nprepare_ahead = 0\nhost_limit = \"1g\""
    );
    let (node, node_file) = shared_gpu(&[&pods[0], &pods[1]], "1g", &swap);
    let env = shared_env(&node_file);
    for pod in pods {
        let mut running = Running::start(&pod, &node.url(), &env, script);
        assert!(running.until_ready()[0].contains("-> 0 "));
        registered(&node, &pod, 1);
        probes.push((pod, running));
    }
    let away = |pod: &Pod| node.hypervisor().pod_swap(&pod.0).state == Residency::Swapped;
    eventually("an idle pod goes ahead of need", || {
        probes.iter().any(|(pod, _)| away(pod))
    });
    let gone = probes
        .iter()
        .position(|(pod, _)| away(pod))
        .expect("one away");
    let went = probes.swap_remove(gone);
    let stayed = probes.remove(0);
    assert!(!away(&stayed.0), "one was enough");
    OneWentAhead { went, stayed, node }
}

/// The swap-outs ahead of need the daemon counted.
fn ahead_outs(status: &hypervisor_swap::SwapReport) -> u64 {
    let out = hypervisor_swap::Direction::Out;
    status
        .serving
        .swaps_of(out, hypervisor_swap::SwapCause::Ahead)
}

#[test]
fn a_pod_brought_back_keeping_its_copies_goes_again_rather_than_another_pinning_in_their_place() {
    // Once one pod is away, its next call brings it back, keeping its
    // copies, and the headroom is short again.
    let script = [
        "alloc", "mem", "512m", "write", "0", "5", "wait", "info", "wait", "check", "0", "5",
        "wait", "check", "0", "5",
    ];
    // The pods outlive their daemon (bindings drop last to first).
    let OneWentAhead {
        went: (went, mut went_probe),
        stayed: (stayed, mut stayed_probe),
        node,
    } = one_went_ahead("fast-again", 1000, &script);
    let away = |pod: &Pod| node.hypervisor().pod_swap(&pod.0).state == Residency::Swapped;
    // The pod that stayed is called first (a query of its memory, over in
    // a moment): the pod away, brought back next, is then not one used
    // twice since the other's last call (a popular pod, which stays).
    stayed_probe.resume();
    let lines = stayed_probe.until_ready();
    assert!(lines[1].starts_with("info 0 free="), "{lines:?}");
    // (A pod may have gone between its first calls already, and come back
    // for the next: what follows is counted from here.)
    let before = node.hypervisor().swap_status();

    // Its call brings it back; it keeps its copies, which fill the host.
    went_probe.resume();
    let lines = went_probe.until_ready();
    assert!(lines[1].starts_with("info 0 free="), "{lines:?}");
    // The other pod would have to pin copies the host has room for only
    // once the pod just back gave its own back: the pod just back goes
    // again once it may (idle, and past `min_resident_ms`), and only
    // copies.
    // (Its residency is written a moment before the daemon counts the
    // swap.)
    eventually("the pod just back goes again", || {
        away(&went) && ahead_outs(&node.hypervisor().swap_status()) == ahead_outs(&before) + 1
    });
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(!away(&stayed), "{} stays", stayed.0);
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (
            status.totals.host_prepares,
            status.totals.bytes_on_host,
            status.totals.host_kept_bytes
        ),
        (before.totals.host_prepares, 512 * MIB, 0),
        "no copies made again, none given back: {status:?}"
    );
    assert_eq!(ahead_outs(&status), ahead_outs(&before) + 1, "{status:?}");
    let record = node.hypervisor().pod_swap(&went.0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );

    for mut running in [went_probe, stayed_probe] {
        running.resume();
        let lines = running.until_ready();
        assert!(lines.iter().any(|l| l.contains("differ=0")), "{lines:?}");
        running.resume();
        let (rest, exit) = running.finish();
        assert!(exit.success(), "{rest:?}");
        assert!(rest.iter().any(|l| l.contains("differ=0")), "{rest:?}");
    }
}

#[test]
fn a_popular_pod_brought_back_keeping_its_copies_stays_and_a_colder_one_goes_ahead_of_need() {
    // The pod away is brought back, keeping its copies, and called again
    // while it stays (two uses since the other's last call), each call a
    // small allocation, over in a moment.
    let script = [
        "alloc", "mem", "512m", "write", "0", "5", "wait", "alloc", "mem", "2m", "wait", "alloc",
        "mem", "2m", "wait", "check", "0", "5",
    ];
    let OneWentAhead {
        went: (popular, mut popular_probe),
        stayed: (cold, mut cold_probe),
        node,
    } = one_went_ahead("fast-popular", 1500, &script);
    let away = |pod: &Pod| node.hypervisor().pod_swap(&pod.0).state == Residency::Swapped;
    let before = node.hypervisor().swap_status();

    // Its call brings it back; 600 ms later (a use of its own, while it
    // may not go yet) it is called again.
    popular_probe.resume();
    let lines = popular_probe.until_ready();
    assert!(lines[1].starts_with("alloc mem 2m -> 0 "), "{lines:?}");
    std::thread::sleep(std::time::Duration::from_millis(600));
    assert!(!away(&popular), "{} may not go yet", popular.0);
    popular_probe.resume();
    let lines = popular_probe.until_ready();
    assert!(lines[1].starts_with("alloc mem 2m -> 0 "), "{lines:?}");

    // Ahead of need the popular pod's copies no longer put it first: the
    // other, colder, has its copies made (the popular pod's given back
    // for the room) and goes, copying only.
    eventually("the colder pod goes ahead of need", || {
        away(&cold) && ahead_outs(&node.hypervisor().swap_status()) == ahead_outs(&before) + 1
    });
    std::thread::sleep(std::time::Duration::from_millis(2_000));
    assert!(!away(&popular), "{} stays", popular.0);
    let status = node.hypervisor().swap_status();
    assert_eq!(
        (
            status.totals.host_prepares,
            status.totals.bytes_on_host,
            status.totals.host_kept_bytes
        ),
        (before.totals.host_prepares + 1, 512 * MIB, 0),
        "the colder pod's copies made, the popular pod's given back: {status:?}"
    );
    assert_eq!(ahead_outs(&status), ahead_outs(&before) + 1, "{status:?}");
    let record = node.hypervisor().pod_swap(&cold.0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );

    // The colder pod is at its first `wait` still.
    for _ in 0..2 {
        cold_probe.resume();
        let lines = cold_probe.until_ready();
        assert!(lines[1].starts_with("alloc mem 2m -> 0 "), "{lines:?}");
    }
    for mut running in [popular_probe, cold_probe] {
        running.resume();
        let (rest, exit) = running.finish();
        assert!(exit.success(), "{rest:?}");
        assert!(rest.iter().any(|l| l.contains("differ=0")), "{rest:?}");
    }
}

#[test]
fn room_for_a_swapped_pods_call_waits_a_moment_for_a_pod_that_keeps_its_copies_rather_than_pin() {
    // Three pods of 352 MiB (and a context each) that just fit a 2 GiB
    // GPU, no headroom: a pod swapped out by hand comes back by making its
    // own room, and allocates; the pod that made that room comes back by
    // making its own.
    let pods = [
        Pod::new("fast-wait-a"),
        Pod::new("fast-wait-b"),
        Pod::new("fast-wait-c"),
    ];
    let swap = "overcommit = true\nidle_after_ms = 200\nmin_resident_ms = 1900\n\
                prepare_ahead = 0\nhost_limit = \"64g\"";
    let (node, node_file) = shared_gpu(&[&pods[0], &pods[1], &pods[2]], "1g", swap);
    let env = shared_env(&node_file);
    let script = [
        "alloc", "mem", "352m", "write", "0", "7", "wait", "check", "0", "7", "wait", "check", "0",
        "7",
    ];
    // The first pod's call once back is an allocation, over in a moment;
    // the others' a check of their bytes.
    let first_script = [
        "alloc", "mem", "352m", "write", "0", "7", "wait", "alloc", "mem", "128m", "wait", "check",
        "0", "7",
    ];
    let mut probes = Vec::new();
    for (i, pod) in pods.iter().enumerate() {
        let script: &[&str] = if i == 0 { &first_script } else { &script };
        let mut running = Running::start(pod, &node.url(), &env, script);
        let lines = running.until_ready();
        assert!(lines[1].starts_with("write 0 7 -> 0 "), "{lines:?}");
        registered(&node, pod, 1);
        probes.push(running);
    }
    let away = |i: usize| node.hypervisor().pod_swap(&pods[i].0).state == Residency::Swapped;
    let (ok, answer) = admin_cli(&node, &["swap", "out", &pods[0].0]);
    assert!(ok, "{answer}");
    // Its call brings it back: room is made by one of the others, which
    // pins host memory as it goes (neither has copies).
    probes[0].resume();
    let lines = probes[0].until_ready();
    assert!(lines[1].starts_with("alloc mem 128m -> 0 "), "{lines:?}");
    let second = (1..3).find(|&i| away(i)).expect("one pod made room");
    let third = 3 - second;
    let before = node.hypervisor().swap_status();

    // At once, the call of the pod that made room: the pod just back keeps
    // its copies and may go within moments, the third would pin. The room
    // waits for the first, which goes, copying only.
    probes[second].resume();
    let lines = probes[second].until_ready();
    assert!(lines.iter().any(|l| l.contains("differ=0")), "{lines:?}");
    assert!(away(0), "the pod that keeps its copies went");
    assert!(!away(third), "the pod without copies stays");
    let status = node.hypervisor().swap_status();
    let record = node.hypervisor().pod_swap(&pods[0].0);
    assert_eq!(
        record.history.last_swap_out_path,
        Some(SwapPath::Fast),
        "{record:?}"
    );
    assert_eq!(
        status.totals.host_prepares, before.totals.host_prepares,
        "{status:?}"
    );
    let out = hypervisor_swap::Direction::Out;
    let demand = |status: &hypervisor_swap::SwapReport| {
        status
            .serving
            .swaps_of(out, hypervisor_swap::SwapCause::Demand)
    };
    assert_eq!(demand(&status), demand(&before) + 1, "{status:?}");

    for mut running in probes {
        running.resume();
        let (rest, exit) = running.finish();
        assert!(exit.success(), "{rest:?}");
        assert!(rest.iter().any(|l| l.contains("differ=0")), "{rest:?}");
    }
}

#[test]
fn an_allocation_the_gpu_has_room_for_only_once_a_pod_goes_is_backed_all_the_same() {
    // Two pods of 768 MiB (and a context each, within a quota of 1100
    // MiB) on a 2 GiB GPU: the
    // second's allocation finds the GPU short, and room is made by the
    // first, idle.
    let (first, second) = (Pod::new("fast-roomy-a"), Pod::new("fast-roomy-b"));
    let swap = "overcommit = true\nidle_after_ms = 200\nprepare_ahead = 0\nhost_limit = \"64g\"";
    let (node, node_file) = shared_gpu(&[&first, &second], "1100m", swap);
    let env = shared_env(&node_file);
    let script = [
        "alloc", "mem", "768m", "write", "0", "3", "wait", "check", "0", "3",
    ];
    let mut a = Running::start(&first, &node.url(), &env, &script);
    let lines = a.until_ready();
    assert!(
        lines.iter().any(|l| l.starts_with("write 0 3 -> 0 ")),
        "{lines:?}"
    );
    registered(&node, &first, 1);
    std::thread::sleep(std::time::Duration::from_millis(400));
    let mut b = Running::start(&second, &node.url(), &env, &script);
    let lines = b.until_ready();
    assert!(
        lines.iter().any(|l| l.starts_with("write 0 3 -> 0 ")),
        "{lines:?}"
    );
    registered(&node, &second, 1);
    let away = |pod: &Pod| node.hypervisor().pod_swap(&pod.0).state == Residency::Swapped;
    assert!(away(&first), "the first pod made the room");

    // The memory the room was made for is the limiter's: all of it leaves
    // by the fast path (memory the driver allocated instead would have
    // been left on the GPU, and the checkpoint taken it).
    let (ok, answer) = admin_cli(&node, &["swap", "out", &second.0]);
    assert!(ok, "{answer}");
    let record = node.hypervisor().pod_swap(&second.0);
    assert_eq!(
        (
            record.state,
            record.history.last_swap_out_path,
            record.history.bytes_on_host
        ),
        (Residency::Swapped, Some(SwapPath::Fast), 768 * MIB),
        "{record:?}"
    );
    for running in [a, b] {
        let mut running = running;
        running.resume();
        let (rest, exit) = running.finish();
        assert!(exit.success(), "{rest:?}");
        assert!(rest.iter().any(|l| l.contains("differ=0")), "{rest:?}");
    }
}
