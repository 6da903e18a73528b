//! The state every part shares: the scheduler, the workers, the hub.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use gpushare_utils::protocol::{Command, CommandResult};
use http_bidir_comm::{Hub, HubEvents};

use crate::timer::PreciseTimer;
use hypervisor_config::{MemoryCapacity, Settings};
use hypervisor_core::scheduler::Scheduler;
use hypervisor_core::spec::Token;
use hypervisor_core::turns::TurnOptions;
use hypervisor_core::workers::Workers;
use hypervisor_corun::{CorunOptions, MpsBoard};
use hypervisor_observer::{GpuObserver, ProcessUtilization, Unhealthy};
use hypervisor_status::metrics::LatencyHistogram;

pub(crate) struct Core {
    pub scheduler: Scheduler,
    pub workers: Workers,
    pub admin_token: Option<Token>,
    pub settings: Settings,
    /// Modification time and length of the config file at the last load.
    pub config_stamp: Option<(SystemTime, u64)>,
    /// The last per-process utilization seen, per GPU index.
    pub utilization: Vec<(u32, ProcessUtilization)>,
}

pub(crate) struct Shared {
    pub(crate) core: Mutex<Core>,
    pub hub: Hub<Command, CommandResult>,
    pub timer: PreciseTimer,
    pub latency: LatencyHistogram,
    pub(crate) observer: Arc<dyn GpuObserver>,
    pub(crate) config_path: Option<PathBuf>,
    pub(crate) events: Mutex<Option<HubEvents<CommandResult>>>,
    pub(crate) handle_sighup: bool,
    pub listen: SocketAddr,
    /// Kubernetes: checks a registering worker's cgroup (`None`: no check).
    pub(crate) identity: std::sync::OnceLock<Arc<dyn hypervisor_core::identity::WorkerIdentity>>,
    /// What the daemon still waits for before it is ready (`GET /readyz`).
    pub(crate) pending: Mutex<std::collections::BTreeSet<String>>,
    /// Co-run mode: the state of each co-run GPU's MPS control daemon.
    pub(crate) corun: std::sync::OnceLock<Arc<MpsBoard>>,
    /// Pods swapped to host memory and back.
    pub(crate) swapper: crate::swap::Swapper,
    /// Commands whose answer someone waits for ([`Hypervisor::ask`]).
    pub(crate) awaited: crate::commands::Awaited,
}

/// The hypervisor's state and operations. Cloning is cheap (one `Arc`).
#[derive(Clone)]
pub struct Hypervisor {
    pub(crate) shared: Arc<Shared>,
}

impl Hypervisor {
    pub(crate) fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.shared.core)
    }

    /// From now on, a worker registers only if `identity` finds it in the
    /// pod it names (set once; later calls are ignored).
    pub fn set_worker_identity(
        &self,
        identity: Arc<dyn hypervisor_core::identity::WorkerIdentity>,
    ) {
        let _ = self.shared.identity.set(identity);
    }

    /// The observer of the node's GPUs.
    pub fn observer(&self) -> &Arc<dyn GpuObserver> {
        &self.shared.observer
    }

    /// Not ready until [`Hypervisor::ready`] is called with the same `what`
    /// (`GET /readyz` answers 503 naming it meanwhile).
    pub fn not_ready(&self, what: &str) {
        lock(&self.shared.pending).insert(what.to_owned());
    }

    /// `what` is done.
    pub fn ready(&self, what: &str) {
        lock(&self.shared.pending).remove(what);
    }

    /// Co-run mode: the status and `/readyz` show `board`'s GPUs, and the
    /// daemon is not ready while an MPS control daemon there is not up (set
    /// once; later calls are ignored).
    pub fn set_corun_board(&self, board: Arc<MpsBoard>) {
        let _ = self.shared.corun.set(board);
    }

    /// Co-run mode on `options`' GPUs: the pods there are told, in their
    /// limits, what share of the SMs their next MPS client takes.
    pub fn set_corun_gpus(&self, options: &CorunOptions) {
        self.core().scheduler.set_corun(options.clone());
    }

    /// Batch pods take turns on `options`' GPUs (always, or while capped
    /// batch pods contend for one), and on no other GPU of the node: the
    /// priority table's turn lines say so from now on.
    pub fn set_turn_gpus(&self, options: &TurnOptions) {
        self.core().scheduler.set_turns(Some(options));
    }

    /// What the daemon still waits for; empty: ready.
    pub fn waiting_for(&self) -> Vec<String> {
        let mut waiting: Vec<String> = lock(&self.shared.pending).iter().cloned().collect();
        if let Some(board) = self.shared.corun.get() {
            waiting.extend(board.waiting());
        }
        waiting
    }

    /// The memory each GPU offers to pods' quotas under the `[swap]`
    /// settings in force: more than its own where the daemon makes room by
    /// swapping idle pods out (what Kubernetes places pods by).
    pub fn memory_capacity(&self) -> MemoryCapacity {
        self.core().settings.swap.memory_capacity()
    }

    /// Where the config says to listen (or the `--listen` override).
    pub fn listen_addr(&self) -> SocketAddr {
        self.shared.listen
    }

    /// The GPUs that are unhealthy now, by UUID; empty where the observer
    /// does not watch health.
    pub fn unhealthy_gpus(&self) -> BTreeMap<String, Unhealthy> {
        self.shared
            .observer
            .health()
            .map(hypervisor_observer::health::HealthBoard::unhealthy)
            .unwrap_or_default()
    }

    /// Changes whenever a GPU's health does; `None` where the observer does
    /// not watch health.
    pub fn gpu_health_changes(&self) -> Option<tokio::sync::watch::Receiver<u64>> {
        self.shared
            .observer
            .health()
            .map(hypervisor_observer::health::HealthBoard::subscribe)
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code panics while holding these locks; if some did, the state is
    // still usable (every update is a step of its own).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(crate) fn stamp(path: &std::path::Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}
