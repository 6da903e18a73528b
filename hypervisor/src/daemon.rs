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

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime};

use gpushare_utils::config::PodId;
use gpushare_utils::protocol::{Command, CommandResult, PodGpuLimits};
use http_bidir_comm::{ClientId, Hub, HubConfig, HubEvent, HubEvents};
use tokio::task::JoinHandle;

use crate::config::{self, Config, ConfigError, Settings};
use crate::metrics::LatencyHistogram;
use crate::observer::{GpuObserver, ObserverError, ProcessUtilization};
use crate::scheduler::{ApplyReport, ScheduleError, Scheduler};
use crate::spec::{GpuSpec, PodSpec, Token};
use crate::status::{ProcessStatus, Status, WorkerStatus};
use crate::timer::PreciseTimer;
use crate::workers::{self, Workers};

/// How often the scheduler runs on its own.
pub const TICK: Duration = Duration::from_millis(10);
/// How often maintenance runs (and the config file is looked at).
pub const MAINTENANCE: Duration = Duration::from_secs(1);

/// Why the hypervisor could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("cannot observe the GPUs: {0}")]
    Observer(#[from] ObserverError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot start the async runtime: {0}")]
    Runtime(#[source] std::io::Error),
    #[error("server: {0}")]
    Serve(#[source] std::io::Error),
}

/// Why a worker request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AuthError {
    /// No such worker (nor one that could be adopted), or the wrong token.
    Unauthorized,
    /// The pod has as many workers as it may.
    TooMany,
}

/// How to start.
pub struct Options {
    pub config: Config,
    /// The file `config` came from: reloaded on SIGHUP and when it changes.
    pub config_path: Option<PathBuf>,
    /// Overrides `config.listen`.
    pub listen: Option<SocketAddr>,
    pub observer: Arc<dyn GpuObserver>,
    /// Reload on SIGHUP (the binary does; tests in one process do not).
    pub handle_sighup: bool,
}

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
    core: Mutex<Core>,
    pub hub: Hub<Command, CommandResult>,
    pub timer: PreciseTimer,
    pub latency: LatencyHistogram,
    observer: Arc<dyn GpuObserver>,
    config_path: Option<PathBuf>,
    events: Mutex<Option<HubEvents<CommandResult>>>,
    handle_sighup: bool,
    pub listen: SocketAddr,
    /// Kubernetes: checks a registering worker's cgroup (`None`: no check).
    pub(crate) identity: std::sync::OnceLock<Arc<dyn crate::identity::WorkerIdentity>>,
}

/// The hypervisor's state and operations. Cloning is cheap (one `Arc`).
#[derive(Clone)]
pub struct Hypervisor {
    pub(crate) shared: Arc<Shared>,
}

impl Hypervisor {
    /// Observes the GPUs, opens the regions of the configured pods and builds
    /// the channel hub. Call inside a tokio runtime (the hub's expiry sweeper
    /// starts on it).
    pub fn new(options: Options) -> Result<Self, Error> {
        let gpus = options.observer.gpus()?;
        let now = Instant::now();
        let mut scheduler = Scheduler::new(gpus, options.config.regions);
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
            }
        });
        *lock(&shared.events) = events;
        Ok(Self { shared })
    }

    pub(crate) fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.shared.core)
    }

    /// From now on, a worker registers only if `identity` finds it in the
    /// pod it names (set once; later calls are ignored).
    pub fn set_worker_identity(&self, identity: Arc<dyn crate::identity::WorkerIdentity>) {
        let _ = self.shared.identity.set(identity);
    }

    /// Where the config says to listen (or the `--listen` override).
    pub fn listen_addr(&self) -> SocketAddr {
        self.shared.listen
    }

    /// Serves on `listener` until `shutdown` completes, with the background
    /// tasks running alongside.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let tasks = self.spawn_tasks();
        let limits = self.core().settings.connections;
        let acceptor = crate::conn::GuardedAcceptor::new(listener, limits).map_err(Error::Serve)?;
        let app = crate::api::routes(&self);
        let result = poem::Server::new_with_acceptor(acceptor)
            .run_with_graceful_shutdown(app, shutdown, Some(Duration::from_secs(1)))
            .await
            .map_err(Error::Serve);
        for task in tasks {
            task.abort();
        }
        result
    }

    fn spawn_tasks(&self) -> Vec<JoinHandle<()>> {
        let mut tasks = Vec::new();
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            let mut every = tokio::time::interval(TICK);
            every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                every.tick().await;
                hv.tick();
            }
        }));
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::time::sleep(MAINTENANCE).await;
                hv.maintain().await;
            }
        }));
        if let Some(mut events) = lock(&self.shared.events).take() {
            let hv = self.clone();
            tasks.push(tokio::spawn(async move {
                while let Some(event) = events.recv().await {
                    hv.on_event(event);
                }
            }));
        }
        let hv = self.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let interval = hv.core().settings.health_interval;
                tokio::time::sleep(interval.unwrap_or(MAINTENANCE)).await;
                if interval.is_some() {
                    hv.ping_all();
                }
            }
        }));
        if self.shared.handle_sighup {
            let hv = self.clone();
            tasks.push(tokio::spawn(async move {
                use tokio::signal::unix::{SignalKind, signal};
                let mut hangups = match signal(SignalKind::hangup()) {
                    Ok(s) => s,
                    Err(error) => {
                        tracing::error!(%error, "cannot listen for SIGHUP; reloads on file change only");
                        return;
                    }
                };
                while hangups.recv().await.is_some() {
                    tracing::info!("SIGHUP: reloading the config");
                    if let Err(error) = hv.reload() {
                        tracing::error!(%error, "config not reloaded; the old one stays");
                    }
                }
            }));
        }
        tasks
    }

    /// One scheduling round over every GPU.
    pub fn tick(&self) {
        self.core().scheduler.tick(Instant::now(), None);
    }

    async fn maintain(&self) {
        let observer = Arc::clone(&self.shared.observer);
        let observed = tokio::task::spawn_blocking(move || {
            let gpus = observer.gpus()?;
            let mut utilization = Vec::new();
            let mut memory = std::collections::BTreeMap::new();
            for gpu in &gpus {
                match observer.process_utilization(gpu.index) {
                    Ok(samples) => utilization.extend(samples.into_iter().map(|s| (gpu.index, s))),
                    Err(error) => {
                        tracing::debug!(%error, gpu = gpu.index, "no process utilization")
                    }
                }
                match observer.process_memory(gpu.index) {
                    Ok(processes) => {
                        memory.insert(gpu.uuid.to_ascii_lowercase(), processes);
                    }
                    Err(error) => tracing::debug!(%error, gpu = gpu.index, "no process memory"),
                }
            }
            Ok::<_, ObserverError>((gpus, utilization, memory))
        })
        .await;
        match observed {
            Ok(Ok((gpus, utilization, memory))) => {
                let mut core = self.core();
                core.scheduler.update_gpus(gpus, Instant::now());
                core.utilization = utilization;
                for m in core.scheduler.audit(&memory) {
                    tracing::warn!(
                        pod = m.pod,
                        gpu = m.uuid,
                        ledger = m.ledger,
                        nvml = m.nvml,
                        "the pod's processes hold more GPU memory than its ledger reports"
                    );
                }
            }
            Ok(Err(error)) => tracing::warn!(%error, "GPU observation failed"),
            Err(error) => tracing::warn!(%error, "GPU observation task failed"),
        }
        let dead_workers = {
            let mut core = self.core();
            let added = core.scheduler.retry_failed(Instant::now());
            if !added.is_empty() {
                tracing::info!(?added, "regions opened on retry");
            }
            for (pod, bytes) in core.scheduler.reclaim_dead() {
                tracing::info!(pod, bytes, "memory of dead processes given back");
            }
            if core.settings.check_pids {
                core.workers
                    .all()
                    .into_iter()
                    .filter(|w| pid_is_gone(w.pid))
                    .map(|w| w.id.clone())
                    .collect()
            } else {
                Vec::new()
            }
        };
        for id in dead_workers {
            self.remove_worker(&id, "its process is gone");
        }
        let changed = match (&self.shared.config_path, self.core().config_stamp) {
            (Some(path), old) => {
                let now = stamp(path);
                now.is_some() && now != old
            }
            (None, _) => false,
        };
        if changed {
            tracing::info!("config file changed: reloading");
            if let Err(error) = self.reload() {
                tracing::error!(%error, "config not reloaded; the old one stays");
                // Do not retry the same broken file every second.
                let now = self.shared.config_path.as_deref().and_then(stamp);
                self.core().config_stamp = now;
            }
        }
    }

    fn on_event(&self, event: HubEvent<CommandResult>) {
        match event {
            HubEvent::Expired(removed) => {
                self.remove_worker(&removed.client, "silent on the channel for the TTL");
            }
            HubEvent::Result { client, result, .. } => {
                if !result.ok {
                    tracing::warn!(worker = %client, message = result.message, "command failed");
                }
                if let Some(worker) = self.core().workers.get_mut(&client) {
                    worker.last_result = Some(result);
                }
            }
            HubEvent::Hello { client, first, .. } => {
                tracing::debug!(worker = %client, first, "hello on the channel");
            }
        }
    }

    /// Forgets worker `id` and gives back its pod's dead processes' memory.
    pub fn remove_worker(&self, id: &ClientId, reason: &str) -> bool {
        let removed = {
            let mut core = self.core();
            let removed = core.workers.remove(id);
            if let Some(worker) = &removed {
                let bytes = core.scheduler.reclaim_pod(worker.pod.as_str());
                tracing::info!(worker = %id, pod = %worker.pod, reason, reclaimed = bytes, "worker removed");
            }
            removed.is_some()
        };
        self.shared.hub.remove_client(id);
        removed
    }

    /// Checks that `id` is a worker of the pod whose token is `token`,
    /// adopting a worker an earlier run registered; returns its pod.
    pub fn authorize_worker(&self, id: &ClientId, token: &str) -> Result<PodId, AuthError> {
        let adopted = {
            let mut core = self.core();
            if let Some(worker) = core.workers.get(id) {
                let pod = worker.pod.clone();
                return match core.scheduler.token(pod.as_str()) {
                    Some(t) if t.matches(token) => Ok(pod),
                    _ => Err(AuthError::Unauthorized),
                };
            }
            let (pod, pid) = workers::parse_id(id.as_str()).ok_or(AuthError::Unauthorized)?;
            let pod = match (core.scheduler.token(pod), core.scheduler.pod_id(pod)) {
                (Some(t), Some(pod)) if t.matches(token) => pod.clone(),
                _ => return Err(AuthError::Unauthorized),
            };
            if core.workers.count_of_pod(pod.as_str()) >= core.settings.max_workers_per_pod {
                return Err(AuthError::TooMany);
            }
            core.workers.adopt(id, &pod, pid);
            pod
        };
        tracing::info!(worker = %id, pod = %adopted, "worker of an earlier run adopted");
        // Gives the worker a queue on the channel, so that it expires if silent.
        self.send(std::slice::from_ref(id), &Command::Health);
        Ok(adopted)
    }

    /// Sends `command` to the workers `ids` (queued on the channel).
    pub fn send(&self, ids: &[ClientId], command: &Command) {
        let name = command_name(command);
        {
            let mut core = self.core();
            for id in ids {
                if let Some(worker) = core.workers.get_mut(id) {
                    worker.last_command = Some(name.to_owned());
                }
            }
        }
        for id in ids {
            if let Err(error) = self.shared.hub.submit(id, command.clone()) {
                tracing::error!(worker = %id, %error, "command not queued");
            }
        }
    }

    /// The workers of `pod`.
    pub fn workers_of(&self, pod: &str) -> Vec<ClientId> {
        self.core().workers.of_pod(pod)
    }

    /// Suspends `pod`: the flag in its region, then `Suspend` to its workers.
    pub fn suspend(&self, pod: &str) -> Result<Vec<ClientId>, ScheduleError> {
        self.set_suspended(pod, true)
    }

    /// Resumes `pod`: the flag cleared, then `Resume` to its workers.
    pub fn resume(&self, pod: &str) -> Result<Vec<ClientId>, ScheduleError> {
        self.set_suspended(pod, false)
    }

    fn set_suspended(&self, pod: &str, suspended: bool) -> Result<Vec<ClientId>, ScheduleError> {
        let ids = {
            let mut core = self.core();
            core.scheduler
                .set_suspended(pod, suspended, Instant::now())?;
            core.workers.of_pod(pod)
        };
        let command = if suspended {
            Command::Suspend
        } else {
            Command::Resume
        };
        self.send(&ids, &command);
        Ok(ids)
    }

    /// Replaces `pod`'s GPU limits until the next reload of the config file;
    /// writes its region and sends `SetLimits` to its workers.
    pub fn set_limits(
        &self,
        pod: &str,
        gpus: Vec<GpuSpec>,
    ) -> Result<(Vec<PodGpuLimits>, Vec<ClientId>), ScheduleError> {
        let (devices, ids) = {
            let mut core = self.core();
            let devices = core.scheduler.set_gpus(pod, gpus, Instant::now())?;
            (devices, core.workers.of_pod(pod))
        };
        self.send(
            &ids,
            &Command::SetLimits {
                devices: devices.clone(),
            },
        );
        Ok((devices, ids))
    }

    /// Sends `Health` to `pod`'s workers.
    pub fn ping(&self, pod: &str) -> Result<Vec<ClientId>, ScheduleError> {
        let ids = {
            let core = self.core();
            if core.scheduler.pod_id(pod).is_none() {
                return Err(ScheduleError::NoSuchPod(pod.to_owned()));
            }
            core.workers.of_pod(pod)
        };
        self.send(&ids, &Command::Health);
        Ok(ids)
    }

    fn ping_all(&self) {
        let ids: Vec<ClientId> = self
            .core()
            .workers
            .all()
            .into_iter()
            .map(|w| w.id.clone())
            .collect();
        self.send(&ids, &Command::Health);
    }

    /// Makes the pods exactly `specs` (what a Kubernetes pod watcher would
    /// call); tells the workers of changed pods, forgets those of removed ones.
    pub fn apply(&self, specs: Vec<PodSpec>) -> ApplyReport {
        let (report, notify, forget) = {
            let mut core = self.core();
            let report = core.scheduler.apply(specs, Instant::now());
            let mut notify = Vec::new();
            for pod in &report.changed {
                if let Ok(devices) = core.scheduler.device_limits(pod) {
                    notify.push((core.workers.of_pod(pod), devices));
                }
            }
            let mut forget = Vec::new();
            for pod in &report.removed {
                for id in core.workers.of_pod(pod) {
                    core.workers.remove(&id);
                    forget.push(id);
                }
            }
            (report, notify, forget)
        };
        for id in &forget {
            self.shared.hub.remove_client(id);
        }
        for (ids, devices) in notify {
            self.send(&ids, &Command::SetLimits { devices });
        }
        log_report(&report);
        report
    }

    /// Reads the config file again and applies it. The listen address and the
    /// worker TTL need a restart; everything else takes effect now.
    pub fn reload(&self) -> Result<ApplyReport, ConfigError> {
        let Some(path) = self.shared.config_path.clone() else {
            return Ok(ApplyReport::default());
        };
        let before = stamp(&path);
        let config = config::load(&path)?;
        {
            let mut core = self.core();
            core.config_stamp = before;
            core.admin_token = config.admin_token.clone();
            if config.settings.worker_ttl != core.settings.worker_ttl {
                tracing::warn!("worker_ttl_ms changes take effect at the next restart");
            }
            core.settings = Settings {
                worker_ttl: core.settings.worker_ttl,
                ..config.settings.clone()
            };
            core.scheduler.set_region_options(config.regions);
        }
        if config.listen != self.shared.listen {
            tracing::warn!(listen = %config.listen, "listen address changes take effect at the next restart");
        }
        Ok(self.apply(config.pods))
    }

    /// Everything the metrics and `hypervisor status` show.
    pub fn status(&self) -> Status {
        let core = self.core();
        let pods = core.scheduler.status(|pod| core.workers.count_of_pod(pod));
        let workers = core
            .workers
            .all()
            .into_iter()
            .map(|w| WorkerStatus {
                id: w.id.to_string(),
                pod: w.pod.to_string(),
                pid: w.pid,
                adopted: w.adopted,
                last_command: w.last_command.clone(),
                last_ok: w.last_result.as_ref().map(|r| r.ok),
            })
            .collect();
        let processes = core
            .utilization
            .iter()
            .map(|(gpu, u)| ProcessStatus {
                gpu_index: *gpu,
                pid: u.pid,
                // Meaningful where the hypervisor shares the pods' pid namespace.
                pod: core
                    .workers
                    .all()
                    .into_iter()
                    .find(|w| w.pid == u.pid)
                    .map(|w| w.pod.to_string()),
                sm_percent: u.sm_percent,
                memory_percent: u.memory_percent,
            })
            .collect();
        Status {
            instance: self.shared.hub.instance_id().to_owned(),
            version: env!("CARGO_PKG_VERSION").to_owned(),
            gpus: core.scheduler.gpus().to_vec(),
            pods,
            workers,
            processes,
            admission: self.shared.latency.snapshot(),
        }
    }
}

/// A hypervisor serving on a runtime of its own: for tests and embedding.
/// Dropping it stops the server (regions stay).
pub struct RunningHypervisor {
    addr: SocketAddr,
    hypervisor: Hypervisor,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl RunningHypervisor {
    /// Binds (port 0: an ephemeral port), builds the state and serves.
    pub fn start(options: Options) -> Result<Self, Error> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("hypervisor")
            .enable_all()
            .build()
            .map_err(Error::Runtime)?;
        let (hypervisor, listener) = runtime.block_on(async {
            let hypervisor = Hypervisor::new(options)?;
            let addr = hypervisor.listen_addr();
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| Error::Listen { addr, source })?;
            Ok::<_, Error>((hypervisor, listener))
        })?;
        let addr = listener.local_addr().map_err(|source| Error::Listen {
            addr: hypervisor.listen_addr(),
            source,
        })?;
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = hypervisor.clone();
        runtime.spawn(async move {
            let shutdown = async {
                let _ = stopped.await;
            };
            if let Err(error) = serving.serve(listener, shutdown).await {
                tracing::error!(%error, "hypervisor server ended");
            }
        });
        Ok(Self {
            addr,
            hypervisor,
            stop: Some(stop),
            runtime: Some(runtime),
        })
    }

    /// Where it listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The state, to look at or drive directly.
    pub fn hypervisor(&self) -> &Hypervisor {
        &self.hypervisor
    }

    /// Stops serving and waits (bounded) for the runtime to wind down.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_timeout(Duration::from_secs(3));
        }
    }
}

impl Drop for RunningHypervisor {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // No code panics while holding these locks; if some did, the state is
    // still usable (every update is a step of its own).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn stamp(path: &std::path::Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

fn log_report(report: &ApplyReport) {
    if report.added.is_empty()
        && report.changed.is_empty()
        && report.removed.is_empty()
        && report.failed.is_empty()
    {
        return;
    }
    tracing::info!(
        added = ?report.added,
        changed = ?report.changed,
        removed = ?report.removed,
        failed = ?report.failed,
        "pods applied"
    );
}

fn command_name(command: &Command) -> &'static str {
    match command {
        Command::Suspend => "suspend",
        Command::Resume => "resume",
        Command::SetLimits { .. } => "set_limits",
        Command::Health => "health",
    }
}

/// Whether no process `pid` exists (in the hypervisor's pid namespace), or it
/// is a zombie (its GPU memory is freed already).
fn pid_is_gone(pid: u32) -> bool {
    match i32::try_from(pid) {
        Ok(pid) if pid > 0 => gpushare_utils::process::process_is_gone(pid, 0),
        _ => true,
    }
}
