//! One node's daemon started from its parts, the same way for `hypervisor
//! serve`, the test cluster and `k8s-e2e`: the hypervisor's state, co-run
//! GPUs' MPS control daemons, the listeners, and with Kubernetes the node
//! agent and the collection of old limiter versions.
//!
//! Two steps, so that the binary can say where it listens before the agent
//! (which may wait for the API server) starts:
//! [`Node::bind`] builds the state, starts the MPS daemons, binds every
//! listener and serves the probes; [`BoundNode::start`] starts the agent
//! and then serves the API. [`Node::start`] does both.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use hypervisor_corun::{CorunError, CorunOptions, MpsBoard, MpsSupervisor};
use hypervisor_daemon::conn::{Listener, bind_tcp};
use hypervisor_daemon::serve::{Listeners, bind_socket};
use hypervisor_daemon::{Hypervisor, Options};
use hypervisor_kubernetes::{AgentOptions, KubeError, NodeAgent};
use hypervisor_observer::ObserverError;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::limiter_files;

/// What a node runs.
pub struct NodeSpec {
    /// The hypervisor: its config, its observer, its node tables.
    pub daemon: Options,
    /// Also serve the whole API on this Unix socket (the pods' way in).
    pub socket: Option<PathBuf>,
    /// Serve `/metrics`, `/healthz` and `/readyz` alone on this address too.
    pub metrics: Option<SocketAddr>,
    /// The co-run GPUs, whose MPS control daemons the node supervises.
    pub corun: Option<CorunOptions>,
    /// The Kubernetes agent. An empty `provision.hypervisor_url` is filled
    /// with the bound TCP address; `provision.node_tables` are the node's,
    /// and so is `provision.corun` where the node has co-run GPUs.
    pub kubernetes: Option<AgentOptions>,
}

/// Why a node could not start, or stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The hypervisor could not start (its GPUs not observed) or failed
    /// while serving.
    #[error(transparent)]
    Daemon(#[from] hypervisor_daemon::Error),
    /// The co-run GPUs' MPS supervision could not start.
    #[error("co-run: {0}")]
    Corun(#[from] CorunError),
    /// The GPUs could not be listed for the Kubernetes agent.
    #[error("cannot list the GPUs: {0}")]
    Observer(#[from] ObserverError),
    /// An API, socket or metrics address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The TCP address, or the Unix socket's path.
        addr: String,
        /// The error from binding it (in use, no permission, a file other
        /// than a socket at the path).
        #[source]
        source: std::io::Error,
    },
    /// The Kubernetes agent could not start, or failed while running.
    #[error("Kubernetes agent: {0}")]
    Agent(#[from] KubeError),
    /// A task of the node (the server, the agent, the collection of old
    /// limiters) panicked.
    #[error("a task of the node ended abnormally: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// The readiness condition while the Kubernetes agent starts.
const AGENT_STARTING: &str = "the Kubernetes agent is starting (checkpoint, ResourceSlice)";
/// How often old limiter versions that no process maps are removed.
const LIMITER_COLLECT_EVERY: Duration = Duration::from_secs(600);
/// How long [`Node::stop`] waits for each task.
const STOP_WAIT: Duration = Duration::from_secs(5);

type Task = JoinHandle<Result<(), NodeError>>;

/// A node whose state is built and whose listeners are bound; only the
/// probes are served yet.
pub struct BoundNode {
    hv: Hypervisor,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    api: Vec<Listener>,
    kubernetes: Option<AgentOptions>,
    parts: Parts,
}

/// What both steps hold and [`Node::stop`] winds down.
struct Parts {
    supervisor: Option<MpsSupervisor>,
    stop: watch::Sender<bool>,
    tasks: Vec<Task>,
    /// Told when a task ends: before the node is stopped, only by failing.
    ended: mpsc::UnboundedSender<()>,
    ended_rx: mpsc::UnboundedReceiver<()>,
}

/// A running node.
pub struct Node {
    hv: Hypervisor,
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    agent: Option<NodeAgent>,
    parts: Parts,
}

impl Node {
    /// [`Node::bind`], then [`BoundNode::start`].
    pub async fn start(spec: NodeSpec) -> Result<Node, NodeError> {
        Self::bind(spec).await?.start().await
    }

    /// Builds the hypervisor, starts the co-run GPUs' MPS control daemons,
    /// binds the API's listeners and serves the probes (not ready while a
    /// Kubernetes agent is to start). Call inside a tokio runtime.
    pub async fn bind(spec: NodeSpec) -> Result<BoundNode, NodeError> {
        let NodeSpec {
            daemon,
            socket,
            metrics,
            corun,
            mut kubernetes,
        } = spec;
        if let Some(options) = &mut kubernetes {
            if corun.is_some() {
                options.provision.corun.clone_from(&corun);
            }
            options.provision.node_tables = daemon.node_tables.clone();
        }
        let hv = Hypervisor::new(daemon)?;
        let supervisor = corun.as_ref().map(MpsSupervisor::start).transpose()?;
        let (stop, _) = watch::channel(false);
        let (ended, ended_rx) = mpsc::unbounded_channel();
        // From here on, an early return drops the supervisor, which quits
        // the MPS daemons.
        let mut parts = Parts {
            supervisor,
            stop,
            tasks: Vec::new(),
            ended,
            ended_rx,
        };
        if let (Some(supervisor), Some(options)) = (&parts.supervisor, &corun) {
            hv.set_corun_board(supervisor.board());
            hv.set_corun_gpus(options);
        }
        let listen = hv.listen_addr();
        let listener = bind_tcp(listen).map_err(listen_error(listen))?;
        let addr = listener.local_addr().map_err(listen_error(listen))?;
        let mut api = vec![Listener::from(listener)];
        if let Some(socket) = &socket {
            let unix = bind_socket(socket).map_err(|source| NodeError::Listen {
                addr: socket.display().to_string(),
                source,
            })?;
            api.push(unix.into());
        }
        if kubernetes.is_some() {
            hv.not_ready(AGENT_STARTING);
            // A DRA allocation, or a device plugin's device files, names
            // each pod's GPU: pods swap there, never move.
            hv.pin_placements();
        }
        let metrics_addr = match metrics {
            Some(at) => {
                let listener = bind_tcp(at).map_err(listen_error(at))?;
                let bound = listener.local_addr().map_err(listen_error(at))?;
                let serving = hv.clone().serve_metrics(listener.into(), parts.stopped());
                parts.spawn(async move { Ok(serving.await?) });
                Some(bound)
            }
            None => None,
        };
        Ok(BoundNode {
            hv,
            addr,
            metrics_addr,
            api,
            kubernetes,
            parts,
        })
    }

    /// The hypervisor's state.
    pub fn hypervisor(&self) -> &Hypervisor {
        &self.hv
    }

    /// The API's TCP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://` and the API's TCP address.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Where the probes and metrics alone are served, if asked.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// The co-run GPUs' states, if the node has any.
    pub fn corun_board(&self) -> Option<Arc<MpsBoard>> {
        self.parts.supervisor.as_ref().map(MpsSupervisor::board)
    }

    /// The Kubernetes agent, if the node runs one.
    pub fn agent(&self) -> Option<&NodeAgent> {
        self.agent.as_ref()
    }

    /// Runs until `shutdown` completes, or until a part of the node (a
    /// server, the agent) ends by itself, which only a failure does; then
    /// stops, and returns the failure.
    pub async fn run_until(mut self, shutdown: impl Future<Output = ()>) -> Result<(), NodeError> {
        tokio::select! {
            () = shutdown => {}
            _ = self.parts.ended_rx.recv() => {
                tracing::error!("a part of the node ended by itself: stopping");
            }
        }
        self.stop().await
    }

    /// Stops serving and the agent (regions and checkpoint stay, as when
    /// the daemon restarts) and quits the MPS control daemons; the first
    /// error of a task is returned.
    pub async fn stop(self) -> Result<(), NodeError> {
        self.parts.stop().await
    }
}

impl BoundNode {
    /// The state, to set before the API is served.
    pub fn hypervisor(&self) -> &Hypervisor {
        &self.hv
    }

    /// The API's TCP address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where the probes and metrics alone are served, if asked.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Starts the Kubernetes agent, if any (the node is ready once it has),
    /// then serves the API: a worker that asks earlier waits in the
    /// accept queue until the pods it serves are known.
    pub async fn start(self) -> Result<Node, NodeError> {
        let BoundNode {
            hv,
            addr,
            metrics_addr,
            api,
            kubernetes,
            mut parts,
        } = self;
        let agent = match kubernetes {
            Some(mut options) => {
                if options.provision.hypervisor_url.is_empty() {
                    options.provision.hypervisor_url = format!("http://{addr}");
                }
                let (link, proc_root) = (
                    options.provision.host_limiter.clone(),
                    options.proc_root.clone(),
                );
                let gpus = hv.observer().gpus()?;
                let agent = NodeAgent::start(hv.clone(), gpus, options).await?;
                hv.ready(AGENT_STARTING);
                let running = agent.clone().run(parts.stopped());
                parts.spawn(async move { Ok(running.await?) });
                let stopped = parts.stopped();
                parts.spawn(collect_limiters(link, proc_root, stopped));
                Some(agent)
            }
            None => None,
        };
        let listeners = Listeners { api, metrics: None };
        let serving = hv.clone().serve_on(listeners, parts.stopped());
        parts.spawn(async move { Ok(serving.await?) });
        Ok(Node {
            hv,
            addr,
            metrics_addr,
            agent,
            parts,
        })
    }
}

impl Parts {
    /// Runs `task` until the node stops; its end is told to
    /// [`Node::run_until`].
    fn spawn(&mut self, task: impl Future<Output = Result<(), NodeError>> + Send + 'static) {
        let ended = self.ended.clone();
        self.tasks.push(tokio::spawn(async move {
            let result = task.await;
            let _ = ended.send(());
            result
        }));
    }

    /// Completes when the node is told to stop.
    fn stopped(&self) -> impl Future<Output = ()> + Send + 'static {
        let mut rx = self.stop.subscribe();
        async move {
            let _ = rx.wait_for(|stop| *stop).await;
        }
    }

    async fn stop(mut self) -> Result<(), NodeError> {
        self.stop.send_replace(true);
        let mut result = Ok(());
        for task in std::mem::take(&mut self.tasks) {
            let abort = task.abort_handle();
            match tokio::time::timeout(STOP_WAIT, task).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(error))) => result = result.and(Err(error)),
                Ok(Err(error)) if error.is_cancelled() => {}
                Ok(Err(error)) => result = result.and(Err(error.into())),
                Err(_) => {
                    tracing::warn!("a task of the node did not stop in time: aborted");
                    abort.abort();
                }
            }
        }
        if let Some(supervisor) = self.supervisor.take() {
            let _ = tokio::task::spawn_blocking(move || supervisor.shutdown()).await;
        }
        result
    }
}

fn listen_error(addr: SocketAddr) -> impl FnOnce(std::io::Error) -> NodeError {
    move |source| NodeError::Listen {
        addr: addr.to_string(),
        source,
    }
}

/// Removes, at start and every [`LIMITER_COLLECT_EVERY`], the limiter
/// versions beside `link` that it does not name and no process maps.
async fn collect_limiters(
    link: PathBuf,
    proc_root: PathBuf,
    stopped: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    let collecting = async {
        let mut every = tokio::time::interval(LIMITER_COLLECT_EVERY);
        loop {
            every.tick().await;
            let (link, proc_root) = (link.clone(), proc_root.clone());
            match tokio::task::spawn_blocking(move || limiter_files::collect(&link, &proc_root))
                .await
            {
                Ok(Ok(collected)) => log_collected(&collected),
                Ok(Err(error)) => tracing::warn!(%error, "old limiter versions not collected"),
                Err(error) => tracing::warn!(%error, "limiter collection task"),
            }
        }
    };
    tokio::select! {
        () = collecting => {}
        () = stopped => {}
    }
    Ok(())
}

fn log_collected(collected: &limiter_files::Collected) {
    for path in &collected.removed {
        tracing::info!(path = %path.display(), "old limiter version removed: no process maps it");
    }
    if let Some(reason) = &collected.unknown {
        tracing::warn!(
            reason,
            "old limiter versions kept: cannot tell which are in use"
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::Arc;

    use hypervisor_core::node_tables::NodeTableNames;
    use hypervisor_observer::SimulatedGpus;

    use super::*;

    fn spec(tables: &NodeTableNames) -> NodeSpec {
        let config = hypervisor_config::parse(
            "listen = \"127.0.0.1:0\"\nhealth_interval_ms = 0\n",
            Path::new("(test)"),
            Path::new("."),
        )
        .unwrap();
        NodeSpec {
            daemon: Options {
                config,
                config_path: None,
                listen: None,
                observer: Arc::new(SimulatedGpus::new(1)),
                handle_sighup: false,
                node_tables: tables.clone(),
            },
            socket: None,
            metrics: Some("127.0.0.1:0".parse().unwrap()),
            corun: None,
            kubernetes: None,
        }
    }

    #[tokio::test]
    async fn a_part_that_fails_stops_the_node_with_its_error() {
        let tables = NodeTableNames {
            activity: format!("gpushare-node-test-fails-{}", std::process::id()),
            priority: format!("gpushare-priority-test-fails-{}", std::process::id()),
        };
        let mut node = Node::start(spec(&tables)).await.unwrap();
        assert!(node.metrics_addr().is_some_and(|a| a.port() != 0));
        node.parts.spawn(async {
            Err(NodeError::Listen {
                addr: "the test's".to_owned(),
                source: std::io::Error::other("gone"),
            })
        });
        let ended = tokio::time::timeout(
            Duration::from_secs(10),
            node.run_until(std::future::pending()),
        )
        .await
        .expect("the node stops by itself");
        let _ = gpushare_utils::shm::unlink(&tables.activity);
        let _ = gpushare_utils::shm::unlink(&tables.priority);
        assert!(matches!(ended, Err(NodeError::Listen { .. })), "{ended:?}");
    }

    #[tokio::test]
    async fn a_node_runs_until_told_and_stops_cleanly() {
        let tables = NodeTableNames {
            activity: format!("gpushare-node-test-runs-{}", std::process::id()),
            priority: format!("gpushare-priority-test-runs-{}", std::process::id()),
        };
        let node = Node::start(spec(&tables)).await.unwrap();
        let url = format!("{}/healthz", node.url());
        let answered = tokio::task::spawn_blocking(move || {
            let agent = ureq::Agent::config_builder()
                .proxy(None)
                .http_status_as_error(false)
                .build()
                .new_agent();
            agent.get(&url).call().map(|r| r.status().as_u16())
        })
        .await
        .unwrap();
        let stopped = tokio::time::timeout(
            Duration::from_secs(10),
            node.run_until(tokio::time::sleep(Duration::from_millis(200))),
        )
        .await
        .expect("the node stops when told");
        let _ = gpushare_utils::shm::unlink(&tables.activity);
        let _ = gpushare_utils::shm::unlink(&tables.priority);
        stopped.unwrap();
        assert_eq!(answered.unwrap(), 200);
    }
}
