//! `GET /api/v1/status`: everything the metrics say, as JSON, and the table
//! `hypervisor status` prints from it.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use hypervisor_core::scheduler::PodStatus;
use hypervisor_core::turns::GpuTurns;
use hypervisor_corun::{CorunGpuStatus, MpsState};
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
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

/// The status as a plain-text table.
pub fn render_table(status: &Status) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "hypervisor {} (instance {})",
        status.version, status.instance
    );
    let _ = writeln!(out, "\nGPUS");
    let _ = writeln!(
        out,
        "{:<5} {:<42} {:>12} {:>12}  NAME",
        "INDEX", "UUID", "MEM USED", "MEM TOTAL"
    );
    for gpu in &status.gpus {
        let _ = writeln!(
            out,
            "{:<5} {:<42} {:>12} {:>12}  {}",
            gpu.index,
            gpu.uuid,
            bytes(gpu.memory_used),
            bytes(gpu.memory_total),
            gpu.name
        );
    }
    let _ = writeln!(out, "\nPODS");
    let _ = writeln!(
        out,
        "{:<20} {:<9} {:>7}  {:<42} {:>3} {:<7} {:>6} {:>5} {:>5} {:>12} {:>12} {:>8} {:>8} {:>8} {:>7}",
        "POD",
        "STATE",
        "WORKERS",
        "GPU",
        "IDX",
        "POLICY",
        "WEIGHT",
        "CAP",
        "SHARE",
        "MEM USED",
        "MEM QUOTA",
        "GRANTED",
        "ACHIEVED",
        "CEILING",
        "WAITING"
    );
    for pod in &status.pods {
        let state = if pod.suspended {
            "suspended"
        } else {
            "running"
        };
        if pod.gpus.is_empty() {
            let _ = writeln!(out, "{:<20} {:<9} {:>7}  -", pod.id, state, pod.workers);
        }
        for gpu in &pod.gpus {
            let _ = writeln!(
                out,
                "{:<20} {:<9} {:>7}  {:<42} {:>3} {:<7} {:>6} {:>5} {:>5} {:>12} {:>12} {:>8} {:>8} {:>8} {:>7}",
                pod.id,
                state,
                pod.workers,
                gpu.uuid.as_deref().unwrap_or(&gpu.gpu),
                gpu.host_index.map_or("-".to_owned(), |o| o.to_string()),
                gpu.policy,
                gpu.weight,
                gpu.cap_percent.map_or("-".to_owned(), |c| format!("{c}%")),
                gpu.share_percent
                    .map_or("-".to_owned(), |s| format!("{s}%")),
                bytes(gpu.memory_used),
                if gpu.memory_quota == 0 {
                    "unlimited".to_owned()
                } else {
                    bytes(gpu.memory_quota)
                },
                share(gpu.rate_ppm),
                percent(gpu.achieved_ppm),
                share(gpu.ceiling_ppm),
                gpu.waiting
            );
        }
    }
    render_spill(&mut out, status);
    render_priority(&mut out, status);
    render_corun(&mut out, status);
    render_turns(&mut out, status);
    render_serving(&mut out, status);
    let _ = writeln!(out, "\nWORKERS");
    let _ = writeln!(out, "{:<48} {:<20} {:>8}  LAST COMMAND", "ID", "POD", "PID");
    for w in &status.workers {
        let last = match (&w.last_command, w.last_ok) {
            (None, _) => "-".to_owned(),
            (Some(c), None) => format!("{c} (no answer)"),
            (Some(c), Some(true)) => format!("{c} (ok)"),
            (Some(c), Some(false)) => format!("{c} (failed)"),
        };
        let _ = writeln!(out, "{:<48} {:<20} {:>8}  {last}", w.id, w.pod, w.pid);
    }
    let a = &status.admission;
    let q = |p| {
        a.quantile_bound_us(p).map_or("-".to_owned(), |us| {
            if us == u64::MAX {
                ">1s".to_owned()
            } else {
                format!("≤{us}µs")
            }
        })
    };
    let _ = writeln!(
        out,
        "\nADMISSION  requests {}  timeouts {}  p50 {}  p99 {}",
        a.count,
        a.timeouts,
        q(0.5),
        q(0.99)
    );
    out
}

/// Once the node has swapped: each GPU's resident set, the swaps by cause
/// and the pods waiting for room, in order.
fn render_serving(out: &mut String, status: &Status) {
    let serving = &status.swap.serving;
    if serving.swaps.is_empty() && status.swap.totals.swapped_pods == 0 {
        return;
    }
    let _ = writeln!(out, "\nRESIDENT");
    for (gpu, pods) in &serving.resident {
        let pods: Vec<String> = pods
            .iter()
            .map(|p| format!("{} ({})", p.pod, bytes(p.bytes)))
            .collect();
        let _ = writeln!(out, "{gpu:<42} {}", pods.join(", "));
    }
    let swaps: Vec<String> = serving
        .swaps
        .iter()
        .map(|(k, n)| format!("{k} {n}"))
        .collect();
    let waiting = if serving.waiting.is_empty() {
        "-".to_owned()
    } else {
        serving.waiting.join(", ")
    };
    let _ = writeln!(
        out,
        "SWAPS  {}  waiting for room: {waiting}",
        swaps.join("  ")
    );
}

fn share(ppm: u32) -> String {
    if ppm == 0 {
        "unlimited".to_owned()
    } else {
        percent(ppm)
    }
}

fn percent(ppm: u32) -> String {
    format!("{:.1}%", f64::from(ppm) / 1e4)
}

fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit < UNITS.len() - 1 {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
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

/// Pods' GPUs with oversubscription on (or host memory still spilled):
/// spilled now, peak and cap. Device memory stays in the table above.
fn render_spill(out: &mut String, status: &Status) {
    let rows: Vec<_> = status
        .pods
        .iter()
        .flat_map(|pod| pod.gpus.iter().map(move |gpu| (pod.id.as_str(), gpu)))
        .filter(|(_, gpu)| gpu.spill_limit > 0 || gpu.spill_used > 0)
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nSPILL (host memory past the quota)");
    let _ = writeln!(
        out,
        "{:<20} {:<42} {:>12} {:>12} {:>12}",
        "POD", "GPU", "SPILLED", "PEAK", "CAP"
    );
    for (id, gpu) in rows {
        let _ = writeln!(
            out,
            "{:<20} {:<42} {:>12} {:>12} {:>12}",
            id,
            gpu.uuid.as_deref().unwrap_or(&gpu.gpu),
            bytes(gpu.spill_used),
            bytes(gpu.spill_peak),
            bytes(gpu.spill_limit)
        );
    }
}

/// Co-run GPUs: their MPS control daemon's state and restarts, and the
/// servers that failed.
fn render_corun(out: &mut String, status: &Status) {
    if status.corun.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nCO-RUN (MPS)");
    let _ = writeln!(
        out,
        "{:<42} {:<8} {:>8} {:>8} {:>8}  DETAIL",
        "GPU", "STATE", "PID", "RESTARTS", "SRV-FAIL"
    );
    for gpu in &status.corun {
        let (state, detail) = match &gpu.state {
            MpsState::Starting => ("starting", String::new()),
            MpsState::Up { since } => ("up", format!("since {since}")),
            MpsState::Down { reason, since } => ("down", format!("since {since}: {reason}")),
            MpsState::Stopped => ("stopped", String::new()),
        };
        let _ = writeln!(
            out,
            "{:<42} {:<8} {:>8} {:>8} {:>8}  {detail}",
            gpu.gpu,
            state,
            gpu.pid.map_or("-".to_owned(), |p| p.to_string()),
            gpu.restarts,
            gpu.server_failures
        );
        if let Some(last) = &gpu.last_server_failure {
            let _ = writeln!(out, "{:<42} last at {}: {}", "", last.at, last.failure);
        }
    }
}

/// GPUs whose batch pods take turns: a turn's length, whose turn it is,
/// how many pods want one and the turns handed over.
fn render_turns(out: &mut String, status: &Status) {
    let gpus: Vec<_> = status.turns.iter().filter(|g| g.takes_turns).collect();
    if gpus.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nTURNS");
    let _ = writeln!(
        out,
        "{:<42} {:>3} {:>8} {:<20} {:>7} {:>10}",
        "GPU", "IDX", "TURN", "HOLDER", "WANTING", "HANDOVERS"
    );
    for gpu in gpus {
        let holder = match (&gpu.holder, gpu.holder_key) {
            (Some(pod), _) => pod.clone(),
            (None, 0) => "-".to_owned(),
            (None, key) => format!("{key:016x}"),
        };
        let _ = writeln!(
            out,
            "{:<42} {:>3} {:>5} ms {:<20} {:>7} {:>10}",
            gpu.gpu,
            gpu.index,
            gpu.quantum_us as f64 / 1e3,
            holder,
            gpu.wanting,
            gpu.handovers
        );
    }
}

/// Pods under priority classes: class, time held, queueing delay.
fn render_priority(out: &mut String, status: &Status) {
    let pods: Vec<_> = status
        .pods
        .iter()
        .filter_map(|pod| Some((pod.id.as_str(), pod.priority.as_ref()?)))
        .collect();
    if pods.is_empty() {
        return;
    }
    let _ = writeln!(out, "\nPRIORITY");
    let _ = writeln!(
        out,
        "{:<20} {:<8} {:>10} {:>12} {:>14} {:>14}",
        "POD", "CLASS", "HELD", "HELD LAUNCH", "QUEUE MEAN", "QUEUE MAX"
    );
    for (id, p) in pods {
        let mean = if p.queue_delay_samples == 0 {
            "-".to_owned()
        } else {
            format!(
                "{:.0} us",
                p.queue_delay_sum_seconds / p.queue_delay_samples as f64 * 1e6
            )
        };
        let _ = writeln!(
            out,
            "{:<20} {:<8} {:>9.3}s {:>12} {:>14} {:>11.0} us",
            id,
            p.class,
            p.held_seconds,
            p.held_launches,
            mean,
            p.queue_delay_max_seconds * 1e6
        );
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn units() {
        assert_eq!(bytes(512), "512 B");
        assert_eq!(bytes(4 << 30), "4.0 GiB");
        assert_eq!(share(0), "unlimited");
        assert_eq!(share(250_000), "25.0%");
    }

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
            instance: String::new(),
            version: String::new(),
            gpus: Vec::new(),
            pods: Vec::new(),
            workers: Vec::new(),
            processes: Vec::new(),
            admission: LatencySnapshot::default(),
            corun: Vec::new(),
            node_table_repairs: Default::default(),
            swap: hypervisor_swap::SwapReport::default(),
            turns: vec![gpu(0, 5_000, Some(holder)), gpu(1, 0, None)],
        }
    }

    #[test]
    fn the_turns_table_names_the_holder_to_the_node_and_to_the_holder_alone() {
        let status = with_turns("trainer");
        let table = render_table(&status);
        let row = table
            .lines()
            .skip_while(|line| *line != "TURNS")
            .nth(2)
            .expect("a row");
        assert_eq!(
            row.split_whitespace().collect::<Vec<_>>(),
            ["GPU-0", "0", "5", "ms", "trainer", "2", "41"]
        );
        assert!(!table.contains("GPU-1 "), "{table}");

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
    fn the_resident_set_is_shown_once_the_node_swaps_and_a_pod_sees_its_own() {
        use hypervisor_swap::{Direction, ResidentPod, ServingBoard, SwapCause};
        let mut status = with_turns("trainer");
        assert!(!render_table(&status).contains("RESIDENT"), "no swap yet");
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
        let table = render_table(&status);
        let rows: Vec<&str> = table.lines().skip_while(|l| *l != "RESIDENT").collect();
        assert_eq!(
            rows[1].split_whitespace().collect::<Vec<_>>(),
            ["gpu-0", "trainer", "(1.0", "GiB),", "web", "(1.0", "GiB)"]
        );
        assert_eq!(
            rows[2],
            "SWAPS  in.demand 1  out.ahead 1  waiting for room: idle"
        );

        // As the CLI reads it.
        let json = serde_json::to_string(&status).unwrap();
        assert_eq!(serde_json::from_str::<Status>(&json).unwrap(), status);

        let own = status.of_pod("trainer").swap.serving;
        assert_eq!(own.resident["gpu-0"], [pod("trainer")]);
        assert!(own.waiting.is_empty());
        assert_eq!(own.recent.len(), 1);
        assert_eq!(own.recent[0].pod, "trainer");
    }
}
