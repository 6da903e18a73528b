//! The running hypervisor: shared state, background tasks, commands to
//! workers, reloads.
//!
//! Background tasks, all on the server's runtime:
//! - the scheduler tick (every 10 ms);
//! - maintenance (every second): look at the GPUs, open regions that failed,
//!   give back dead processes' memory, drop workers whose pid is gone (with
//!   `check_pids`), reload the config when its file changed;
//! - the channel's events: a worker silent for the TTL is removed and its
//!   pod's dead processes' memory given back; answers are recorded;
//! - health pings to every worker;
//! - SIGHUP: reload.
//!
//! Nothing holds the state lock across an `.await`, and no request waits on
//! another worker: a hung client only ties up its own connection.
//!
//! The parts: [`state`] (what is shared), [`tasks`] (what runs in the
//! background), [`auth`] (which worker may do what), [`commands`] (what is
//! sent to workers), [`reload`] (a new config) and [`report`] (the status,
//! gathered into `hypervisor-status`'s model); [`api`] (the HTTP routes,
//! the status and metrics among them) served by [`serve`] on the listeners
//! of [`conn`] (bounded connections); [`source`] (where pods come from
//! besides the file); `processes` (which processes are a pod's, proven by
//! the kernel);
//! `swap` (pods swapped to host memory and back, and room made for others);
//! [`timer`] (the tick's precise sleeps). The decisions themselves are
//! `hypervisor-core`'s.

pub mod api;
mod auth;
mod commands;
pub use http_bidir_comm::server::conn;
mod processes;
mod reload;
mod report;
pub mod serve;
pub mod source;
mod state;
mod swap;
mod tasks;
pub mod timer;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;

use http_bidir_comm::{ClientId, Hub, HubConfig};

use crate::timer::PreciseTimer;
use hypervisor_config::Config;
use hypervisor_core::node_tables::{NodeTableNames, NodeTables};
use hypervisor_core::scheduler::Scheduler;
use hypervisor_core::workers::Workers;
use hypervisor_observer::{GpuObserver, ObserverError};
use hypervisor_status::metrics::LatencyHistogram;

pub use auth::AuthError;
pub use state::Hypervisor;
pub(crate) use state::{Core, Shared};
use state::{lock, stamp};
pub use swap::{DrainReport, MoveAnswer, ROOM_ASKS_PER_POD, RoomMade, RoomSlot, SwapRefusal};
use tasks::log_report;
pub use tasks::{BUSY_POLL, MAINTENANCE, TICK};

/// Why the hypervisor could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The GPUs could not be listed at start (NVML not loaded or failing).
    #[error("cannot observe the GPUs: {0}")]
    Observer(#[from] ObserverError),
    /// A listener's address could not be read, or serving on it failed.
    #[error("server: {0}")]
    Serve(#[source] std::io::Error),
}

/// How to start.
pub struct Options {
    /// The config, loaded: its pods are opened at start, its settings and
    /// tokens used until a reload replaces them.
    pub config: Config,
    /// The file `config` came from: reloaded on SIGHUP and when it changes.
    pub config_path: Option<PathBuf>,
    /// Overrides `config.listen`.
    pub listen: Option<SocketAddr>,
    /// Where the GPUs, their processes and their health are read (NVML,
    /// simulated GPUs, or a test's).
    pub observer: Arc<dyn GpuObserver>,
    /// Reload on SIGHUP (the binary does; tests in one process do not).
    pub handle_sighup: bool,
    /// The node tables this hypervisor makes (tests name their own).
    pub node_tables: NodeTableNames,
}

impl Hypervisor {
    /// Observes the GPUs, opens the regions of the configured pods and builds
    /// the channel hub. Call inside a tokio runtime (the hub's expiry sweeper
    /// starts on it).
    pub fn new(options: Options) -> Result<Self, Error> {
        let gpus = options.observer.gpus()?;
        let now = Instant::now();
        let tables = NodeTables::create(&options.node_tables, &options.config.regions);
        let mut scheduler = Scheduler::new(gpus, options.config.regions, tables);
        // No GPU takes turns until told ([`Hypervisor::set_turn_gpus`]),
        // whatever a pod wrote.
        scheduler.set_turns(None);
        let report = scheduler.apply(options.config.pods.clone(), now);
        log_report(&report);
        let config_stamp = options.config_path.as_deref().and_then(stamp);
        let core = Core {
            scheduler,
            workers: Workers::new(),
            admin_token: options.config.admin_token.clone(),
            settings: options.config.settings.clone(),
            config_stamp,
            utilization: Vec::new(),
        };
        let hub_config = |weak: Weak<Shared>| {
            HubConfig {
                client_ttl: options.config.settings.worker_ttl,
                ..HubConfig::default()
            }
            .with_auth(move |id: &ClientId, token: Option<&str>| {
                let Some(shared) = weak.upgrade() else {
                    return false;
                };
                token.is_some_and(|token| Hypervisor { shared }.authorize_worker(id, token).is_ok())
            })
        };
        let mut events = None;
        let shared = Arc::new_cyclic(|weak: &Weak<Shared>| {
            let (hub, rx) = Hub::new(hub_config(weak.clone()));
            events = Some(rx);
            Shared {
                core: Mutex::new(core),
                hub,
                timer: PreciseTimer::new(),
                latency: LatencyHistogram::default(),
                observer: options.observer,
                config_path: options.config_path,
                events: Mutex::new(None),
                handle_sighup: options.handle_sighup,
                listen: options.listen.unwrap_or(options.config.listen),
                identity: std::sync::OnceLock::new(),
                pending: Mutex::default(),
                corun: std::sync::OnceLock::new(),
                swapper: swap::Swapper::default(),
                awaited: commands::Awaited::default(),
            }
        });
        *lock(&shared.events) = events;
        Ok(Self { shared })
    }
}
