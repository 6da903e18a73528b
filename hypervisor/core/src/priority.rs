//! What priority classes cost each pod, read from the node's priority table
//! ([`crate::node_tables`]): the time its launches were held (batch) and its
//! queueing delay (latency).

use gpushare_utils::node_table::pod_key;
use gpushare_utils::priority::{NodePriority, PriorityStats};
use serde::{Deserialize, Serialize};

/// One pod's priority figures, summed over its GPUs.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PriorityStatus {
    /// `latency` when the pod is of that class on any GPU, else `batch`.
    pub class: String,
    /// Total time its launches were held for latency pods.
    pub held_seconds: f64,
    /// How many of its launches were held (0 for a latency pod).
    pub held_launches: u64,
    /// Queueing delay of its sampled launches: from the launch call until
    /// the GPU reached it.
    pub queue_delay_sum_seconds: f64,
    /// How many launches were sampled into `queue_delay_sum_seconds`;
    /// their mean is the sum over this.
    pub queue_delay_samples: u64,
    /// Longest queueing delay of a sampled launch, over all its GPUs.
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

/// The figures of pod `id` in `table`, when a limiter of it recorded any.
pub fn status(table: &NodePriority, id: &str) -> Option<PriorityStatus> {
    table.stats(pod_key(id)).map(PriorityStatus::from)
}
