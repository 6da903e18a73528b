//! What priority classes cost each pod, read from the node's priority table
//! (`/dev/shm/gpushare-priority-v1`, created by the first latency pod): the
//! time its launches were held (batch) and its queueing delay (latency).

use std::sync::OnceLock;

use gpushare_utils::activity::pod_key;
use gpushare_utils::priority::{NodePriority, PRIORITY_REGION, PriorityStats};
use serde::{Deserialize, Serialize};

/// One pod's priority figures, summed over its GPUs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PriorityStatus {
    /// `latency` when the pod is of that class on any GPU, else `batch`.
    pub class: String,
    /// Total time its launches were held for latency pods.
    pub held_seconds: f64,
    pub held_launches: u64,
    /// Queueing delay of its sampled launches: from the launch call until
    /// the GPU reached it.
    pub queue_delay_sum_seconds: f64,
    pub queue_delay_samples: u64,
    pub queue_delay_max_seconds: f64,
}

impl From<PriorityStats> for PriorityStatus {
    fn from(stats: PriorityStats) -> Self {
        let seconds = |ns: u64| ns as f64 / 1e9;
        Self {
            class: stats.class.as_str().to_owned(),
            held_seconds: seconds(stats.held_ns),
            held_launches: stats.held_launches,
            queue_delay_sum_seconds: seconds(stats.queue_ns),
            queue_delay_samples: stats.queue_samples,
            queue_delay_max_seconds: seconds(stats.queue_max_ns),
        }
    }
}

/// The figures of pod `id`, when a limiter of it recorded any.
pub fn status(id: &str) -> Option<PriorityStatus> {
    table()?.stats(pod_key(id)).map(PriorityStatus::from)
}

/// The node's table once some latency pod created it (never created here).
fn table() -> Option<&'static NodePriority> {
    static TABLE: OnceLock<NodePriority> = OnceLock::new();
    if let Some(table) = TABLE.get() {
        return Some(table);
    }
    let table = NodePriority::open_named(PRIORITY_REGION, false).ok()?;
    Some(TABLE.get_or_init(|| table))
}
