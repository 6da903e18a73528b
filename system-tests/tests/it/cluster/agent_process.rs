//! The node's daemon and agent as a process of their own, as the DaemonSet
//! runs them: the `hypervisor` binary with `serve --kubernetes`, its
//! folders under a test's (state, CDI specs, the kubelet's), the pods'
//! Unix socket at a fixed path, simulated GPUs and node tables of the
//! test's own. Each run logs at INFO, as the DaemonSet's does, to a file of
//! its own; the process is killed with the test's thread (the parent-death
//! signal), and when dropped.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use hypervisor_core::node_tables::NodeTableNames;
use serde_json::Value;
use system_tests::artifacts;
use system_tests::wait::eventually_some_async;

use super::DRIVER;

/// What the binary prints once its API listens (its first line).
const LISTENING: &str = "hypervisor listening on ";

/// The running daemon and agent, and how to start them again.
pub(crate) struct AgentProcess {
    /// The folder its state, CDI specs and logs are in.
    dir: PathBuf,
    command: Vec<String>,
    tables: NodeTableNames,
    child: Option<Child>,
    /// Runs started so far: the current one's log is `run-<runs>.log`.
    runs: usize,
    /// This run's API address (loopback, a port of its own each run).
    addr: String,
}

impl AgentProcess {
    /// Starts `hypervisor serve --kubernetes` for node `node` with `gpus`
    /// simulated GPUs, every folder under `dir`, the API server reached
    /// with `kubeconfig` and the limiter the CDI specs mount at `limiter`;
    /// returns once its API listens.
    pub(crate) async fn start(
        dir: &Path,
        node: &str,
        gpus: u32,
        kubeconfig: &Path,
        limiter: &Path,
    ) -> Self {
        let path = |name: &str| dir.join(name).display().to_string();
        let command = vec![
            "serve".to_owned(),
            "--kubernetes".to_owned(),
            format!("--node-name={node}"),
            format!("--driver={DRIVER}"),
            format!("--kubeconfig={}", kubeconfig.display()),
            format!("--simulate-gpus={gpus}"),
            "--listen=127.0.0.1:0".to_owned(),
            // A fixed address for the pods, as the DaemonSet's socket: the
            // pod files written before a restart stay right after it.
            format!("--socket={}", path("run/hypervisor.sock")),
            format!("--state-dir={}", path("state")),
            format!("--cdi-dir={}", path("cdi")),
            format!("--kubelet-dir={}", path("kubelet")),
            // The agent's /dev/shm is the host's here.
            "--host-region-dir=/dev/shm".to_owned(),
            format!("--host-limiter={}", limiter.display()),
        ];
        let mut process = Self {
            dir: dir.to_owned(),
            command,
            tables: kube_fakes::node::node_tables(dir),
            child: None,
            runs: 0,
            addr: String::new(),
        };
        process.restart().await;
        process
    }

    /// The node tables the daemon makes, for the test to remove at its end.
    pub(crate) fn tables(&self) -> &NodeTableNames {
        &self.tables
    }

    /// The kubelet's plugin registry, where the agent registers its plugin.
    pub(crate) fn registry(&self) -> PathBuf {
        self.dir.join("kubelet/plugins_registry")
    }

    /// `kill -9`: the process ends at once, leaving everything it made.
    pub(crate) fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Whether the process still runs.
    pub(crate) fn running(&mut self) -> bool {
        self.child
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// Starts the process (again, after [`AgentProcess::kill`]) with the
    /// same flags, state and node; returns once its API listens.
    pub(crate) async fn restart(&mut self) {
        self.kill();
        self.runs += 1;
        let log = self.log_path();
        let out = std::fs::File::create(&log).unwrap();
        let err = out.try_clone().unwrap();
        let mut command = Command::new(artifacts::hypervisor());
        command
            .args(&self.command)
            .env("HYPERVISOR_LOG", "info")
            .env(
                gpushare_utils::node_table::NODE_REGION_VARIABLE,
                &self.tables.activity,
            )
            .env(
                gpushare_utils::node_table::PRIORITY_REGION_VARIABLE,
                &self.tables.priority,
            )
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        kube_control_plane::dies_with_parent(&mut command);
        self.child = Some(command.spawn().unwrap());
        self.addr = eventually_some_async("the hypervisor's API listening", || {
            let listening = std::fs::read_to_string(&log).ok().and_then(|text| {
                let line = text.lines().find(|l| l.starts_with(LISTENING))?;
                Some(line[LISTENING.len()..].trim().to_owned())
            });
            std::future::ready(listening)
        })
        .await;
    }

    /// This run's log file.
    fn log_path(&self) -> PathBuf {
        self.dir.join(format!("run-{}.log", self.runs))
    }

    /// What this run logged so far.
    pub(crate) fn log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// What `hypervisor status --json` says, as an operator runs it beside
    /// the daemon.
    pub(crate) fn status(&self) -> Value {
        let output = Command::new(artifacts::hypervisor())
            .args(["status", "--json", "--addr", &self.addr])
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "hypervisor status: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        serde_json::from_slice(&output.stdout).unwrap()
    }

    /// Pod `uid` as `hypervisor status` shows it, if the daemon holds it.
    pub(crate) fn pod(&self, uid: &str) -> Option<Value> {
        let status = self.status();
        status["pods"]
            .as_array()?
            .iter()
            .find(|p| p["id"] == uid)
            .cloned()
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        self.kill();
    }
}
