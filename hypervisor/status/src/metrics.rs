//! Prometheus text exposition of the status, and the admission latency
//! histogram (lock-free: every admission records into it; [`histogram`]).

use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::status::Status;
use hypervisor_observer::{GpuInfo, Unhealthy};

mod histogram;
mod serving;

pub use histogram::{LATENCY_BOUNDS_US, LatencyHistogram};

/// Metric families in the order they are written, each with its samples.
#[derive(Default)]
struct Exposition {
    families: Vec<Family>,
}

struct Family {
    name: &'static str,
    kind: &'static str,
    help: &'static str,
    samples: Vec<String>,
}

impl Exposition {
    fn family(&mut self, name: &'static str, kind: &'static str, help: &'static str) -> usize {
        self.families.push(Family {
            name,
            kind,
            help,
            samples: Vec::new(),
        });
        self.families.len() - 1
    }

    /// Adds `<name><suffix>{labels} value` to family `at`.
    fn sample(&mut self, at: usize, suffix: &str, labels: &str, value: impl std::fmt::Display) {
        let family = &mut self.families[at];
        let labels = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        family
            .samples
            .push(format!("{}{suffix}{labels} {value}", family.name));
    }

    fn render(self) -> String {
        let mut out = String::with_capacity(8192);
        for family in self.families {
            let _ = writeln!(out, "# HELP {} {}", family.name, family.help);
            let _ = writeln!(out, "# TYPE {} {}", family.name, family.kind);
            for sample in family.samples {
                out.push_str(&sample);
                out.push('\n');
            }
        }
        out
    }
}

/// Renders `status` in the Prometheus text format (version 0.0.4).
pub fn render(status: &Status) -> String {
    let mut x = Exposition::default();
    let gpu_total = x.family(
        "gpushare_gpu_memory_total_bytes",
        "gauge",
        "GPU memory installed.",
    );
    let gpu_used = x.family(
        "gpushare_gpu_memory_used_bytes",
        "gauge",
        "GPU memory in use, all processes.",
    );
    for gpu in &status.gpus {
        let labels = format!("gpu=\"{}\",index=\"{}\"", escape(&gpu.uuid), gpu.index);
        x.sample(gpu_total, "", &labels, gpu.memory_total);
        x.sample(gpu_used, "", &labels, gpu.memory_used);
    }
    let suspended = x.family(
        "gpushare_pod_suspended",
        "gauge",
        "1 while the pod is suspended.",
    );
    let workers = x.family(
        "gpushare_pod_workers",
        "gauge",
        "Registered workers of the pod.",
    );
    let per_gpu = [
        x.family(
            "gpushare_pod_memory_used_bytes",
            "gauge",
            "Memory the pod holds on the GPU.",
        ),
        x.family(
            "gpushare_pod_memory_quota_bytes",
            "gauge",
            "The pod's memory quota on the GPU (0 = unlimited).",
        ),
        x.family(
            "gpushare_pod_share_granted_ratio",
            "gauge",
            "Share of the GPU's time granted: the bucket's rate (0 = unlimited).",
        ),
        x.family(
            "gpushare_pod_share_ceiling_ratio",
            "gauge",
            "Elastic ceiling of the pod's share.",
        ),
        x.family(
            "gpushare_pod_share_achieved_ratio",
            "gauge",
            "GPU time charged per wall time over the last second.",
        ),
        x.family(
            "gpushare_pod_waiting_launches",
            "gauge",
            "Launches waiting for budget now.",
        ),
        x.family(
            "gpushare_pod_launches_total",
            "counter",
            "Launches admitted.",
        ),
        x.family(
            "gpushare_pod_share_forfeited_seconds_total",
            "counter",
            "GPU time the pod earned beyond its bucket's depth (5 ms), unused.",
        ),
        x.family(
            "gpushare_pod_active",
            "gauge",
            "1 while the pod wants the GPU.",
        ),
    ];
    let nvml = x.family(
        "gpushare_pod_memory_nvml_bytes",
        "gauge",
        "Memory NVML attributes to the pod's processes on the GPU (audit of the ledger).",
    );
    let driver_held = x.family(
        "gpushare_pod_memory_driver_held_bytes",
        "gauge",
        "Of the pod's used memory, what the driver holds outside allocations (contexts, modules, heaps, graph and pool memory).",
    );
    let unaccounted = x.family(
        "gpushare_pod_memory_unaccounted_bytes",
        "gauge",
        "Memory NVML attributes to the pod beyond its ledger, charged to it by the audit.",
    );
    for pod in &status.pods {
        let pod_label = format!("pod=\"{}\"", escape(&pod.id));
        x.sample(suspended, "", &pod_label, u8::from(pod.suspended));
        x.sample(workers, "", &pod_label, pod.workers);
        for gpu in &pod.gpus {
            let Some(uuid) = &gpu.uuid else { continue };
            let labels = format!("{pod_label},gpu=\"{}\"", escape(uuid));
            let values = [
                gpu.memory_used.to_string(),
                gpu.memory_quota.to_string(),
                ratio(gpu.rate_ppm),
                ratio(gpu.ceiling_ppm),
                ratio(gpu.achieved_ppm),
                gpu.waiting.to_string(),
                gpu.launches.to_string(),
                format!("{:.6}", gpu.forfeited_ns as f64 / 1e9),
                u8::from(gpu.active).to_string(),
            ];
            for (family, value) in per_gpu.iter().zip(values) {
                x.sample(*family, "", &labels, value);
            }
            if let Some(bytes) = gpu.memory_nvml {
                x.sample(nvml, "", &labels, bytes);
            }
            x.sample(driver_held, "", &labels, gpu.memory_driver_held);
            x.sample(unaccounted, "", &labels, gpu.memory_unaccounted);
        }
    }
    render_spill(&mut x, status);
    render_priority(&mut x, status);
    render_node_tables(&mut x, status);
    render_corun(&mut x, status);
    render_turns(&mut x, status);
    render_swap(&mut x, status);
    let process_sm = x.family(
        "gpushare_process_sm_utilization_ratio",
        "gauge",
        "SM utilization of a process, as NVML samples it.",
    );
    for p in &status.processes {
        let gpu = status
            .gpus
            .iter()
            .find(|g| g.index == p.gpu_index)
            .map_or(String::new(), |g| escape(&g.uuid));
        let labels = format!(
            "gpu=\"{gpu}\",pid=\"{}\",pod=\"{}\"",
            p.pid,
            escape(p.pod.as_deref().unwrap_or(""))
        );
        x.sample(process_sm, "", &labels, f64::from(p.sm_percent) / 100.0);
    }
    let hist = x.family(
        "gpushare_admission_latency_seconds",
        "histogram",
        "Time from an admission request's arrival to its answer.",
    );
    let mut cumulative = 0;
    for &(bound, n) in &status.admission.buckets {
        cumulative += n;
        let le = if bound == u64::MAX {
            "+Inf".to_owned()
        } else {
            format!("{}", bound as f64 / 1e6)
        };
        x.sample(hist, "_bucket", &format!("le=\"{le}\""), cumulative);
    }
    x.sample(hist, "_sum", "", status.admission.sum_seconds);
    x.sample(hist, "_count", "", status.admission.count);
    let timeouts = x.family(
        "gpushare_admission_timeouts_total",
        "counter",
        "Admission requests answered without budget.",
    );
    x.sample(timeouts, "", "", status.admission.timeouts);
    x.render()
}

/// `gpushare_gpu_healthy`: 1 per GPU of `gpus`, 0 for those in
/// `unhealthy` (by UUID; the reason is in the log and the ResourceSlice's
/// taint). Appended to [`render`]'s exposition by whoever has both.
pub fn render_health(gpus: &[GpuInfo], unhealthy: &BTreeMap<String, Unhealthy>) -> String {
    let mut x = Exposition::default();
    let healthy = x.family(
        "gpushare_gpu_healthy",
        "gauge",
        "1 while the GPU is healthy; 0 after a critical XID or ECC error (until a reset and restart) or while it is lost.",
    );
    for gpu in gpus {
        let labels = format!("gpu=\"{}\",index=\"{}\"", escape(&gpu.uuid), gpu.index);
        x.sample(
            healthy,
            "",
            &labels,
            u8::from(!unhealthy.contains_key(&gpu.uuid)),
        );
    }
    x.render()
}

/// Per pod and GPU with oversubscription on (or host memory still spilled):
/// the spill, kept apart from the device memory families.
fn render_spill(x: &mut Exposition, status: &Status) {
    let families = [
        x.family(
            "gpushare_pod_spill_bytes",
            "gauge",
            "Host memory the pod holds past its quota on the GPU (oversubscription).",
        ),
        x.family(
            "gpushare_pod_spill_peak_bytes",
            "gauge",
            "Highest spill of the pod on the GPU since its region was created.",
        ),
        x.family(
            "gpushare_pod_spill_limit_bytes",
            "gauge",
            "The pod's cap of host memory past its quota on the GPU (0 = no oversubscription).",
        ),
    ];
    for pod in &status.pods {
        for gpu in &pod.gpus {
            let Some(uuid) = &gpu.uuid else { continue };
            if gpu.spill_limit == 0 && gpu.spill_used == 0 {
                continue;
            }
            let labels = format!("pod=\"{}\",gpu=\"{}\"", escape(&pod.id), escape(uuid));
            let values = [gpu.spill_used, gpu.spill_peak, gpu.spill_limit];
            for (family, value) in families.iter().zip(values) {
                x.sample(*family, "", &labels, value);
            }
        }
    }
}

/// Per pod: the time its launches were held and its queueing delay.
fn render_priority(x: &mut Exposition, status: &Status) {
    let class = x.family(
        "gpushare_pod_latency_class",
        "gauge",
        "1 when the pod is of class latency, 0 for batch.",
    );
    let held = x.family(
        "gpushare_pod_held_seconds_total",
        "counter",
        "Time the pod's launches were held while a latency pod was active.",
    );
    let held_launches = x.family(
        "gpushare_pod_held_launches_total",
        "counter",
        "Launches held while a latency pod was active.",
    );
    let delay = x.family(
        "gpushare_pod_queue_delay_seconds",
        "summary",
        "Queueing delay of sampled launches: from the launch call until the GPU reached it.",
    );
    let delay_max = x.family(
        "gpushare_pod_queue_delay_max_seconds",
        "gauge",
        "Longest queueing delay sampled.",
    );
    for pod in &status.pods {
        let Some(p) = &pod.priority else { continue };
        let labels = format!("pod=\"{}\"", escape(&pod.id));
        x.sample(class, "", &labels, u8::from(p.class == "latency"));
        x.sample(held, "", &labels, p.held_seconds);
        x.sample(held_launches, "", &labels, p.held_launches);
        x.sample(delay, "_sum", &labels, p.queue_delay_sum_seconds);
        x.sample(delay, "_count", &labels, p.queue_delay_samples);
        x.sample(delay_max, "", &labels, p.queue_delay_max_seconds);
    }
}

/// Per node table: how many times the daemon repaired it.
fn render_node_tables(x: &mut Exposition, status: &Status) {
    let repairs = x.family(
        "gpushare_node_table_repairs_total",
        "counter",
        "Times the daemon found a node table damaged (a wrong header, or the table shrunk, removed or replaced) and repaired it.",
    );
    for table in hypervisor_core::node_tables::TableKind::ALL {
        let labels = format!("table=\"{}\"", table.as_str());
        x.sample(repairs, "", &labels, status.node_table_repairs.of(table));
    }
}

/// Per co-run GPU: whether its MPS control daemon answers, its restarts and
/// its servers' failures.
fn render_corun(x: &mut Exposition, status: &Status) {
    let up = x.family(
        "gpushare_mps_up",
        "gauge",
        "1 while the co-run GPU's MPS control daemon answers; 0 while it starts or is down (its pods' processes are then refused CUDA).",
    );
    let restarts = x.family(
        "gpushare_mps_restarts_total",
        "counter",
        "Times the co-run GPU's MPS control daemon was started again after it exited or did not answer.",
    );
    let server_failures = x.family(
        "gpushare_mps_server_failures_total",
        "counter",
        "MPS servers of the co-run GPU that exited failing, as its control daemon logged it (a server that fails to start refuses its clients CUDA).",
    );
    for gpu in &status.corun {
        let labels = format!("gpu=\"{}\"", escape(&gpu.gpu));
        x.sample(up, "", &labels, u8::from(gpu.is_up()));
        x.sample(restarts, "", &labels, gpu.restarts);
        x.sample(server_failures, "", &labels, gpu.server_failures);
    }
}

/// Per GPU whose batch pods take turns: a turn's length, the pods that want
/// one and the turns handed over.
fn render_turns(x: &mut Exposition, status: &Status) {
    let quantum = x.family(
        "gpushare_gpu_turn_seconds",
        "gauge",
        "How long a batch pod's turn lasts on the GPU, as its line of the priority table says (0: no turns).",
    );
    let wanting = x.family(
        "gpushare_gpu_turn_wanting_pods",
        "gauge",
        "Batch pods that want a turn on the GPU.",
    );
    let handovers = x.family(
        "gpushare_gpu_turn_handovers_total",
        "counter",
        "Turns handed from one batch pod to another on the GPU.",
    );
    for gpu in status.turns.iter().filter(|g| g.takes_turns) {
        let labels = format!("gpu=\"{}\"", escape(&gpu.gpu));
        x.sample(quantum, "", &labels, gpu.quantum_us as f64 / 1e6);
        x.sample(wanting, "", &labels, gpu.wanting);
        x.sample(handovers, "", &labels, gpu.handovers);
    }
}

/// Pods swapped to host memory: how many, their bytes there, and the swaps
/// done, failed and the time they took.
fn render_swap(x: &mut Exposition, status: &Status) {
    let totals = &status.swap.totals;
    let node = [
        (
            "gpushare_swapped_pods",
            "gauge",
            "Pods whose device memory is in host memory now (swapped out, or being swapped).",
            totals.swapped_pods as f64,
        ),
        (
            "gpushare_swap_host_bytes",
            "gauge",
            "Bytes of swapped pods' device memory held in host memory.",
            totals.bytes_on_host as f64,
        ),
        (
            "gpushare_swap_host_kept_bytes",
            "gauge",
            "Pinned host memory resident pods' processes keep for their next fast swap-out (counted against host_limit, given back when a swap needs the room).",
            totals.host_kept_bytes as f64,
        ),
        (
            "gpushare_swap_host_prepares_total",
            "counter",
            "Idle pods whose processes pinned their host copies ahead of a fast swap-out ([swap] prepare_ahead), so that it only copies.",
            totals.host_prepares as f64,
        ),
        (
            "gpushare_swap_host_prepared_bytes_total",
            "counter",
            "Host memory pinned ahead of fast swap-outs.",
            totals.host_prepared_bytes as f64,
        ),
        (
            "gpushare_swap_outs_total",
            "counter",
            "Pods swapped out to host memory.",
            totals.swap_outs as f64,
        ),
        (
            "gpushare_swap_ins_total",
            "counter",
            "Pods swapped back onto their GPUs.",
            totals.swap_ins as f64,
        ),
        (
            "gpushare_swap_failures_total",
            "counter",
            "Swaps refused by the driver or failed (the pod is left running, or in host memory to be tried again).",
            totals.failures as f64,
        ),
        (
            "gpushare_swap_out_seconds_total",
            "counter",
            "Seconds spent swapping pods out.",
            totals.swap_out_seconds,
        ),
        (
            "gpushare_swap_in_seconds_total",
            "counter",
            "Seconds spent swapping pods in.",
            totals.swap_in_seconds,
        ),
        (
            "gpushare_moves_total",
            "counter",
            "Pods moved to another GPU of the node.",
            totals.moves as f64,
        ),
        (
            "gpushare_move_seconds_total",
            "counter",
            "Seconds spent moving pods between GPUs.",
            totals.move_seconds,
        ),
    ];
    for (name, kind, help, value) in node {
        let at = x.family(name, kind, help);
        x.sample(at, "", "", value);
    }
    let by_path = x.family(
        "gpushare_swaps_total",
        "counter",
        "Swaps done, by direction and by path (fast: the pod's processes moved their memory themselves; checkpoint: the driver's checkpoint).",
    );
    let moved = x.family(
        "gpushare_swap_bytes_total",
        "counter",
        "Bytes swaps moved, by direction (out: to host memory; in: back to the GPUs).",
    );
    for (direction, all, fast, bytes) in [
        (
            "out",
            totals.swap_outs,
            totals.fast_swap_outs,
            totals.bytes_out,
        ),
        ("in", totals.swap_ins, totals.fast_swap_ins, totals.bytes_in),
    ] {
        for (path, count) in [("fast", fast), ("checkpoint", all.saturating_sub(fast))] {
            let labels = format!("direction=\"{direction}\",path=\"{path}\"");
            x.sample(by_path, "", &labels, count);
        }
        x.sample(moved, "", &format!("direction=\"{direction}\""), bytes);
    }
    let on_host = x.family(
        "gpushare_pod_swap_host_bytes",
        "gauge",
        "Bytes of the pod's device memory in host memory now (0 while it is on its GPUs).",
    );
    for (pod, swap) in &status.swap.pods {
        let labels = format!("pod=\"{}\",state=\"{}\"", escape(pod), swap.state.as_str());
        x.sample(on_host, "", &labels, swap.history.bytes_on_host);
    }
    serving::render(x, &status.swap.serving);
}

fn ratio(ppm: u32) -> String {
    format!("{}", f64::from(ppm) / 1e6)
}

/// Escapes a label value (`\`, `"`, newline).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests;
