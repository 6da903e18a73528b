//! Turns on time-sliced GPUs: `hypervisor serve --turns-gpu` makes the
//! named GPU's line of the priority table say a turn's length, sets it back
//! when a pod changes it, keeps every other GPU of the node from taking
//! turns, and reports the turns in its status and metrics.

use crate::common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::daemon::{Killed, bin, listening};
use common::{ConfigFile, call, use_node_tables, wait_for};
use gpushare_utils::limits::uuid_key;
use gpushare_utils::node_table::TableAccess;
use gpushare_utils::priority::NodePriority;
use hypervisor_observer::SimulatedGpus;

/// How long the daemon's check (once a second) may take to set a line back.
const CHECKED: Duration = Duration::from_secs(5);

/// `hypervisor serve` on `config` with two simulated GPUs and `args`.
fn serve(config: &ConfigFile, args: &[&str]) -> Command {
    let mut command = Command::new(bin());
    command
        .args(["serve", "--config"])
        .arg(&config.path)
        .args(["--simulate-gpus", "2"])
        .args(args);
    use_node_tables(&mut command, &config.path);
    command
}

#[test]
fn a_turns_gpu_takes_turns_of_turn_ms_and_the_daemon_sets_back_what_pods_write() {
    let config = ConfigFile::new("listen = \"127.0.0.1:0\"\n");
    let (_daemon, addr) = listening(serve(&config, &["--turns-gpu", "0", "--turn-ms", "7"]));
    let tables = common::node_tables(&config.path);
    // What a pod's limiter maps.
    let priority =
        NodePriority::open_named(&tables.priority, &TableAccess::managed(None)).expect("table");
    let (gpu0, gpu1) = (SimulatedGpus::uuid(0), SimulatedGpus::uuid(1));

    // Set before the daemon listens.
    let line = priority.turn_line(uuid_key(&gpu0)).expect("GPU 0's line");
    assert_eq!(line.quantum_ns(), 7_000_000);
    assert!(
        priority
            .turn_line(uuid_key(&gpu1))
            .is_none_or(|line| line.quantum_ns() == 0),
        "GPU 1 takes no turns"
    );

    // A pod drops GPU 0's turns and has GPU 1 take some: both set back.
    line.set_quantum_us(0);
    let planted = priority.claim_turn_line(uuid_key(&gpu1)).expect("a line");
    planted.set_quantum_us(3_000);
    assert!(
        wait_for(CHECKED, || line.quantum_ns() == 7_000_000
            && planted.quantum_ns() == 0),
        "set back within {CHECKED:?}: GPU 0 {} ns, GPU 1 {} ns",
        line.quantum_ns(),
        planted.quantum_ns()
    );

    // The status says which GPU takes turns; the metrics count its handovers.
    let (code, body) = call("GET", &format!("http://{addr}/api/v1/status"), None, None);
    assert_eq!(code, 200, "{body}");
    let status: serde_json::Value = serde_json::from_str(&body).expect("JSON");
    let turns = status["turns"].as_array().expect("turns");
    let of = |uuid: &str| {
        turns
            .iter()
            .find(|gpu| gpu["gpu"] == uuid)
            .unwrap_or_else(|| panic!("{uuid} in {body}"))
    };
    assert_eq!(of(&gpu0)["takes_turns"], true);
    assert_eq!(of(&gpu0)["quantum_us"], 7_000);
    assert_eq!(of(&gpu0)["holder"], serde_json::Value::Null);
    assert_eq!(of(&gpu1)["takes_turns"], false);
    assert_eq!(of(&gpu1)["quantum_us"], 0);
    let (code, metrics) = call("GET", &format!("http://{addr}/metrics"), None, None);
    assert_eq!(code, 200);
    let sample = format!("gpushare_gpu_turn_handovers_total{{gpu=\"{gpu0}\"}} 0");
    assert!(
        metrics.lines().any(|l| l == sample),
        "{sample} in {metrics}"
    );
    assert!(
        !metrics.contains(&format!("gpushare_gpu_turn_seconds{{gpu=\"{gpu1}\"}}")),
        "{metrics}"
    );
}

#[test]
fn a_gpu_cannot_both_corun_and_take_turns() {
    let config = ConfigFile::new("listen = \"127.0.0.1:0\"\n");
    let corun_dir = config.dir.join("mps");
    let mut child = Killed(
        serve(&config, &["--turns-gpu", "1", "--corun-gpu", "1"])
            .arg("--corun-dir")
            .arg(&corun_dir)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn hypervisor"),
    );
    let mut status = None;
    assert!(
        wait_for(Duration::from_secs(10), || {
            status = child.0.try_wait().expect("wait");
            status.is_some()
        }),
        "still running"
    );
    let status = status.expect("exited");
    let mut stderr = String::new();
    std::io::Read::read_to_string(child.0.stderr.as_mut().expect("stderr"), &mut stderr)
        .expect("stderr");
    assert!(!status.success(), "started: {stderr}");
    assert!(
        stderr.contains("--turns-gpu 1")
            && stderr.contains("--corun-gpu")
            && stderr.contains(&SimulatedGpus::uuid(1)),
        "{stderr}"
    );
}
