//! A time-sliced GPU takes turns by itself under the daemon: while two or
//! more batch pods with a compute cap launch on it, their limiters take
//! turns on its line of the priority table, and once they stop (or are
//! removed), after the daemon's calm second, it time-slices again. A capped pod beside one
//! without a cap, or a GPU the daemon was told to leave alone
//! (`--no-auto-turns`), takes none.

use std::process::Child;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gpushare_utils::limits::uuid_key;
use gpushare_utils::node_table::TableAccess;
use gpushare_utils::priority::NodePriority;
use hypervisor_core::turns::{CALM, TurnOptions};
use system_tests::RunningNode;
use system_tests::daemon::double_gpus;
use system_tests::pod::{Pod, node_tables};
use system_tests::{daemon, probes};

/// Each pod launches 200 µs kernels for this long, in ms.
const RUN_MS: &str = "800";
/// A turn, µs.
const TURN_US: u32 = 5_000;

/// A daemon for two pods on the double's GPU 0, `gpus[i]` the limits of
/// pod `i` there, its GPU taking turns by itself or (`auto` false) not.
fn node(pods: &[Pod; 2], gpus: [&str; 2], auto: bool) -> RunningNode {
    let mut text = "listen = \"127.0.0.1:0\"\n".to_owned();
    for (pod, gpu) in pods.iter().zip(gpus) {
        text.push_str(&format!(
            "\n[[pods]]\nid = \"{}\"\ntoken = \"token-{}\"\n\n[[pods.gpus]]\nindex = 0\n{gpu}\n",
            pod.0, pod.0
        ));
    }
    let running = daemon::hypervisor(&pods[0], &text, Arc::new(double_gpus(1)));
    let uuid = gpushare_examples::uuid(0);
    running.hypervisor().set_turn_gpus(&TurnOptions {
        gpus: Vec::new(),
        auto_gpus: if auto { vec![uuid] } else { Vec::new() },
        quantum_us: TURN_US,
    });
    running
}

/// `pod`'s batch process launching back to back under `running`, with the
/// node tables of `node` (the first pod's).
fn launch(pod: &Pod, node: &Pod, running: &RunningNode) -> Child {
    let token = format!("token-{}", pod.0);
    let mut command = probes::probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_HYPERVISOR", &running.url()),
            ("CUDA_LIMITER_TOKEN", &token),
            // A real GPU's queue fills: a pod waiting for its turn idles
            // its device.
            ("GPUSHARE_DOUBLE_QUEUE_DEPTH", "4"),
        ],
        &["run", "kernel", "200", RUN_MS],
    );
    probes::use_node_tables(&mut command, node);
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("probe")
}

/// What one pair of pods did: whether the daemon's status said GPU 0 took
/// turns by itself while they ran, and the turns handed over.
struct Ran {
    took_turns: bool,
    handovers: u64,
}

/// Runs both pods at once under `running`, watching its status.
fn run_pair(pods: &[Pod; 2], running: &RunningNode) -> Ran {
    let mut children: Vec<Child> = pods
        .iter()
        .map(|pod| launch(pod, &pods[0], running))
        .collect();
    let mut took_turns = false;
    while children
        .iter_mut()
        .any(|child| child.try_wait().expect("wait").is_none())
    {
        took_turns |= gpu0(running).is_some_and(|gpu| gpu.takes_turns && gpu.automatic);
        std::thread::sleep(Duration::from_millis(20));
    }
    for child in children {
        probes::check(&child.wait_with_output().expect("probe"));
    }
    Ran {
        took_turns,
        handovers: line(&pods[0]).map_or(0, |line| line.1),
    }
}

/// GPU 0's turns as the daemon's status says them.
fn gpu0(running: &RunningNode) -> Option<hypervisor_core::turns::GpuTurns> {
    running
        .hypervisor()
        .status()
        .turns
        .into_iter()
        .find(|gpu| gpu.index == 0)
}

/// GPU 0's turn line, as a pod's limiter reads it: its turn's length (ns)
/// and the turns handed over; `None` where it has none.
fn line(node: &Pod) -> Option<(u64, u64)> {
    let table =
        NodePriority::open_named(&node_tables(node).priority, &TableAccess::managed(None)).ok()?;
    let line = table.turn_line(uuid_key(&gpushare_examples::uuid(0)))?;
    Some((line.quantum_ns(), line.view(0).handovers))
}

#[test]
fn capped_batch_pods_take_turns_while_they_share_a_gpu_and_it_time_slices_after() {
    let _serial = probes::serial();
    let pods = [Pod::new("auto-turns-a"), Pod::new("auto-turns-b")];
    let capped = "cap = 40\npolicy = \"fixed\"";
    let running = node(&pods, [capped, capped], true);
    let ran = run_pair(&pods, &running);
    println!(
        "took turns: {}, {} handovers",
        ran.took_turns, ran.handovers
    );
    // 800 ms in turns of at most 5 ms, from the daemon's first tick that
    // saw both pods launch.
    assert!(ran.took_turns, "the status never said so");
    assert!(ran.handovers >= 20, "{} handovers", ran.handovers);

    // Idle: after the daemon's 200 ms of counting a pod and its calm
    // second, the line says no turns again (how long the calm lasts, to the
    // tick, is the core's turn test's: here the probes' exits take part of
    // it).
    let stopped = Instant::now();
    let deadline = stopped + CALM + Duration::from_secs(3);
    while line(&pods[0]).is_none_or(|line| line.0 != 0) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = stopped.elapsed();
    println!("turns stopped {after:?} after the pods");
    assert_eq!(line(&pods[0]).map(|line| line.0), Some(0), "{after:?}");
    let gpu = gpu0(&running).expect("GPU 0");
    assert!(gpu.automatic && !gpu.takes_turns, "{gpu:?}");

    // Again, and the pods removed from the daemon as they stop: a GPU no
    // pod is placed on takes no turns either.
    let again = run_pair(&pods, &running);
    assert!(again.took_turns, "the status never said so");
    running.hypervisor().apply(Vec::new());
    let removed = Instant::now();
    while gpu0(&running).is_some_and(|gpu| gpu.takes_turns) && removed.elapsed() < CALM * 4 {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        line(&pods[0]).map(|line| line.0),
        Some(0),
        "{:?}",
        removed.elapsed()
    );
}

#[test]
fn a_capped_pod_beside_one_without_a_cap_or_told_not_to_takes_no_turns() {
    let _serial = probes::serial();
    let capped = "cap = 40\npolicy = \"fixed\"";
    for (gpus, auto) in [([capped, "share = 30"], true), ([capped, capped], false)] {
        let pods = [Pod::new("auto-turns-c"), Pod::new("auto-turns-d")];
        let running = node(&pods, gpus, auto);
        let ran = run_pair(&pods, &running);
        let context = format!("{gpus:?}, auto {auto}");
        assert!(!ran.took_turns, "{context}");
        assert_eq!(ran.handovers, 0, "{context}");
        assert!(line(&pods[0]).is_none_or(|line| line.0 == 0), "{context}");
    }
}
