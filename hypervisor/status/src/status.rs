//! `GET /api/v1/status`: everything the metrics say, as JSON (the
//! `hypervisor` binary prints it as a table).

use serde::{Deserialize, Serialize};

use hypervisor_core::scheduler::PodStatus;
use hypervisor_core::turns::GpuTurns;
use hypervisor_corun::CorunGpuStatus;
use hypervisor_observer::GpuInfo;

/// One worker, as the status shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WorkerStatus {
    /// The worker's id, `<pod>-<pid>-<n>`.
    pub id: String,
    /// The pod it registered for.
    pub pod: String,
    /// Its pid, as its own pid namespace numbers it.
    pub pid: u32,
    /// Known from a request with the id an earlier run of the daemon gave it,
    /// not from a registration with this run.
    pub adopted: bool,
    /// The last command sent to it (`suspend`, `resume`, `set_limits`,
    /// `health`); `None` before any.
    pub last_command: Option<String>,
    /// Whether the last answer said ok; `None` before any answer.
    pub last_ok: Option<bool>,
}

/// One process's recent use of a GPU, as NVML reports it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ProcessStatus {
    /// NVML index of the GPU.
    pub gpu_index: u32,
    /// Host pid, as NVML reports it.
    pub pid: u32,
    /// The pod of the worker with this pid, when one is registered.
    pub pod: Option<String>,
    /// Share of the last sample period the process had a kernel running,
    /// 0 to 100.
    pub sm_percent: u32,
    /// Share of the last sample period the process read or wrote device
    /// memory, 0 to 100.
    pub memory_percent: u32,
}

/// The whole status.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Status {
    /// Changes when the hypervisor restarts.
    pub instance: String,
    /// The daemon's version (its crate's).
    pub version: String,
    /// The GPUs last observed, by index.
    pub gpus: Vec<GpuInfo>,
    /// Every pod scheduled, by id.
    pub pods: Vec<PodStatus>,
    /// Every registered worker, by id.
    pub workers: Vec<WorkerStatus>,
    /// Per-process utilization (empty where the GPUs cannot tell).
    #[serde(default)]
    pub processes: Vec<ProcessStatus>,
    /// Latency of admission requests since the daemon started.
    pub admission: LatencySnapshot,
    /// Co-run mode: each co-run GPU's MPS control daemon (empty without).
    #[serde(default)]
    pub corun: Vec<CorunGpuStatus>,
    /// How many times the daemon repaired each node table.
    #[serde(default)]
    pub node_table_repairs: hypervisor_core::node_tables::Repairs,
    /// Pods swapped to host memory: the node's totals and each pod that
    /// ever swapped or is away now.
    #[serde(default)]
    pub swap: hypervisor_swap::SwapReport,
    /// Per GPU of the node: whether its batch pods take turns, and whose
    /// turn it is.
    #[serde(default)]
    pub turns: Vec<GpuTurns>,
}

impl Status {
    /// What pod `pod` may see: the node's GPUs and the admission figures,
    /// and of the pods, workers and processes its own alone.
    pub fn of_pod(mut self, pod: &str) -> Self {
        self.pods.retain(|p| p.id == pod);
        self.workers.retain(|w| w.pod == pod);
        self.swap.pods.retain(|id, _| id == pod);
        self.swap.serving.only(pod);
        self.processes.retain(|p| p.pod.as_deref() == Some(pod));
        // Whose turn it is, where it is the pod's own.
        for gpu in &mut self.turns {
            if gpu.holder.as_deref() != Some(pod) {
                gpu.holder = None;
                gpu.holder_key = 0;
            }
        }
        self
    }
}

/// A copy of the histogram.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct LatencySnapshot {
    /// `(upper bound in µs, count in that bucket)`, non-cumulative; the last
    /// bound is `u64::MAX`.
    pub buckets: Vec<(u64, u64)>,
    /// Admission requests answered since the daemon started.
    pub count: u64,
    /// Their latencies added up, in seconds.
    pub sum_seconds: f64,
    /// Of them, those answered with no budget: the pod's bucket refills
    /// later than the admission's hold, or the pod is suspended.
    pub timeouts: u64,
}

impl LatencySnapshot {
    /// The upper bound (µs) of the bucket holding quantile `q` (0..=1).
    pub fn quantile_bound_us(&self, q: f64) -> Option<u64> {
        if self.count == 0 {
            return None;
        }
        let rank = (q * self.count as f64).ceil().max(1.0) as u64;
        let mut seen = 0;
        for &(bound, n) in &self.buckets {
            seen += n;
            if seen >= rank {
                return Some(bound);
            }
        }
        self.buckets.last().map(|b| b.0)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A node of two GPUs, the first taking turns of 5 ms held by `holder`.
    pub(crate) fn with_turns(holder: &str) -> Status {
        let gpu = |index: u32, quantum_us: u64, holder: Option<&str>| GpuTurns {
            gpu: format!("GPU-{index}"),
            index,
            takes_turns: quantum_us > 0,
            automatic: false,
            quantum_us,
            holder: holder.map(str::to_owned),
            holder_key: holder.map_or(0, gpushare_utils::node_table::pod_key),
            wanting: 2,
            handovers: 41,
        };
        Status {
            turns: vec![gpu(0, 5_000, Some(holder)), gpu(1, 0, None)],
            ..Status::default()
        }
    }

    /// [`with_turns`], after swaps: `trainer` and `web` resident on `gpu-0`,
    /// `idle` swapped out ahead of need and waiting for room.
    pub(crate) fn with_swaps() -> Status {
        use hypervisor_swap::{Direction, ResidentPod, ServingBoard, SwapCause};
        let mut status = with_turns("trainer");
        let board = ServingBoard::default();
        board.swapped("idle", Direction::Out, SwapCause::Ahead);
        board.swapped("trainer", Direction::In, SwapCause::Demand);
        let pod = |name: &str| ResidentPod {
            pod: name.into(),
            bytes: 1 << 30,
        };
        let resident = std::collections::BTreeMap::from([(
            "gpu-0".to_owned(),
            vec![pod("trainer"), pod("web")],
        )]);
        status.swap.serving = board.report(resident, vec!["idle".into()]);
        status
    }

    #[test]
    fn a_pod_sees_whose_turn_it_is_only_where_it_is_its_own() {
        let status = with_turns("trainer");
        let own = status.clone().of_pod("trainer");
        assert_eq!(own.turns[0].holder.as_deref(), Some("trainer"));
        let other = status.of_pod("other");
        assert_eq!(
            (other.turns[0].holder.as_deref(), other.turns[0].holder_key),
            (None, 0)
        );
        assert_eq!(other.turns[0].handovers, 41);
    }

    #[test]
    fn a_pod_sees_its_own_swaps_and_the_cli_reads_what_the_daemon_writes() {
        let status = with_swaps();
        let json = serde_json::to_string(&status).unwrap();
        assert_eq!(serde_json::from_str::<Status>(&json).unwrap(), status);

        let own = status.of_pod("trainer").swap.serving;
        assert_eq!(
            own.resident["gpu-0"],
            [hypervisor_swap::ResidentPod {
                pod: "trainer".into(),
                bytes: 1 << 30
            }]
        );
        assert!(own.waiting.is_empty());
        assert_eq!(own.recent.len(), 1);
        assert_eq!(own.recent[0].pod, "trainer");
    }
}
