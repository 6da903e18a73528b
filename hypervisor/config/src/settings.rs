//! The daemon's settings once the file is read: worker and connection
//! tuning, and swapping.

use std::time::Duration;

pub use http_bidir_comm::ConnLimits;

use super::overcommit::{MemoryCapacity, OvercommitRatio};

/// Daemon tuning from the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// A worker with no channel request for this long is removed.
    pub worker_ttl: Duration,
    /// Health pings to every worker; `None`: off.
    pub health_interval: Option<Duration>,
    /// Remove workers whose pid no longer exists (only meaningful when the
    /// hypervisor shares the pods' pid namespace).
    pub check_pids: bool,
    /// Most workers one pod may register at once.
    pub max_workers_per_pod: usize,
    /// Bounds on HTTP connections (needs a restart to change).
    pub connections: ConnLimits,
    /// Swapping pods to host memory, and memory overcommit (`[swap]`).
    pub swap: SwapSettings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            worker_ttl: Duration::from_secs(30),
            health_interval: Some(Duration::from_secs(10)),
            check_pids: false,
            max_workers_per_pod: 1024,
            connections: ConnLimits::default(),
            swap: SwapSettings::default(),
        }
    }
}

/// The `[swap]` table: an operator may swap any pod out and in whenever the
/// driver supports it; with overcommit, the daemon also swaps idle pods out
/// by itself when a pod needs memory its GPU does not have free.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwapSettings {
    /// The GPUs (NVML indexes) whose pods the daemon swaps out to make room;
    /// `None`: every GPU; empty: none (the default).
    pub overcommit: Option<Vec<u32>>,
    /// How far the quotas placed on those GPUs may add up past their memory
    /// (Kubernetes places pods by it; local pods' quotas are never summed).
    pub overcommit_ratio: OvercommitRatio,
    /// A pod is idle, and may make room, once its last CUDA call is this
    /// old (at least 100 ms).
    pub idle_after: Duration,
    /// Where latency-class pods come among those that make room.
    pub latency_pods: hypervisor_swap::LatencyPods,
    /// How idle pods are ranked to make room (LRU-2 by default).
    pub ranking: hypervisor_swap::Ranking,
    /// A pod brought back this recently is swapped out again only when no
    /// other can go (and never ahead of need).
    pub min_resident: Duration,
    /// Bytes the daemon keeps free on each GPU that overcommits, swapping
    /// idle pods out ahead of need, so that a swapped pod's call waits for
    /// its own swap-in only (0: none, the default).
    pub headroom: u64,
    /// Host memory swapped pods may take on the node, in bytes.
    pub host_limit: u64,
    /// The longest an allocation or a swap-in waits for room.
    pub room_wait: Duration,
    /// Host memory, in bytes, that the copies resident pods' processes
    /// keep may reach by copies pinned ahead: the idle pods that go next
    /// on a GPU (to make room where it overcommits, by hand or a drain
    /// elsewhere) have their processes pin their host copies ahead of
    /// their (fast) swap-out, so that it only copies; within `host_limit`
    /// too (default twice `headroom`; 0: never).
    pub prepare_ahead: u64,
    /// The driver library whose checkpoint API swaps (`libcuda.so.1`).
    pub cuda_library: String,
    /// Whether a GPU that turns unhealthy (an XID, an uncorrected ECC
    /// error, lost) is drained at once: its pods moved to healthy GPUs, or
    /// swapped out where they cannot move.
    pub drain_unhealthy: bool,
}

impl SwapSettings {
    /// Whether the daemon makes room on the GPU of NVML index `index`.
    pub fn overcommits(&self, index: u32) -> bool {
        self.overcommit
            .as_ref()
            .is_none_or(|gpus| gpus.contains(&index))
    }

    /// The memory each GPU offers to pods' quotas under these settings.
    pub fn memory_capacity(&self) -> MemoryCapacity {
        MemoryCapacity::new(self.overcommit.clone(), self.overcommit_ratio)
    }
}

impl Default for SwapSettings {
    fn default() -> Self {
        Self {
            overcommit: Some(Vec::new()),
            overcommit_ratio: OvercommitRatio::DEFAULT,
            idle_after: Duration::from_secs(30),
            latency_pods: hypervisor_swap::LatencyPods::Last,
            ranking: hypervisor_swap::Ranking::Lru2,
            min_resident: Duration::from_secs(5),
            headroom: 0,
            host_limit: gpushare_utils::limits::default_spill_limit().saturating_mul(2),
            room_wait: Duration::from_secs(60),
            prepare_ahead: 0,
            cuda_library: "libcuda.so.1".to_owned(),
            drain_unhealthy: false,
        }
    }
}
