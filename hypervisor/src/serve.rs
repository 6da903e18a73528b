//! Serving the hypervisor over HTTP: its routes ([`crate::api`]) and its
//! background tasks, on listeners of the caller's (TCP, the pods' Unix
//! socket, a metrics-only one) or on a runtime of its own.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use crate::api::Audience;
use crate::conn::{GuardedAcceptor, Listener};
use crate::daemon::{Error, Hypervisor, Options};

/// Where the daemon answers.
#[derive(Debug, Default)]
pub struct Listeners {
    /// The whole API: TCP (`--listen`) and the pods' Unix socket (`--socket`).
    pub api: Vec<Listener>,
    /// `/metrics`, `/healthz` and `/readyz` alone (`--metrics-listen`).
    pub metrics: Option<Listener>,
}

impl Hypervisor {
    /// Serves on `listener` until `shutdown` completes, with the background
    /// tasks running alongside.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let listeners = Listeners {
            api: vec![listener.into()],
            metrics: None,
        };
        self.serve_on(listeners, shutdown).await
    }

    /// Serves the API on every listener of `listeners.api` and the metrics
    /// routes on `listeners.metrics` until `shutdown` completes, with the
    /// background tasks running alongside.
    pub async fn serve_on(
        self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let tasks = self.spawn_tasks();
        let result = self.serve_routes(listeners, shutdown).await;
        for task in tasks {
            task.abort();
        }
        result
    }

    /// Serves `/metrics`, `/healthz` and `/readyz` alone on `listener`,
    /// without the background tasks: for probes while the rest starts.
    pub async fn serve_metrics(
        self,
        listener: Listener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        let listeners = Listeners {
            api: Vec::new(),
            metrics: Some(listener),
        };
        self.serve_routes(listeners, shutdown).await
    }

    async fn serve_routes(
        &self,
        listeners: Listeners,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), Error> {
        use futures::FutureExt;
        let shutdown = shutdown.shared();
        let limits = self.core().settings.connections;
        let mut servers = Vec::new();
        for listener in listeners.api {
            let audience = match listener {
                Listener::Tcp(_) => Audience::Node,
                Listener::Unix(_) => Audience::Pods,
            };
            let acceptor = GuardedAcceptor::new(listener, limits).map_err(Error::Serve)?;
            let app = crate::api::routes(self, audience);
            servers.push(
                poem::Server::new_with_acceptor(acceptor)
                    .run_with_graceful_shutdown(app, shutdown.clone(), Some(GRACE))
                    .boxed(),
            );
        }
        if let Some(listener) = listeners.metrics {
            let acceptor = GuardedAcceptor::new(listener, limits).map_err(Error::Serve)?;
            let app = crate::api::metrics_routes(self);
            servers.push(
                poem::Server::new_with_acceptor(acceptor)
                    .run_with_graceful_shutdown(app, shutdown.clone(), Some(GRACE))
                    .boxed(),
            );
        }
        let results = futures::future::join_all(servers).await;
        results
            .into_iter()
            .collect::<Result<Vec<()>, _>>()
            .map(|_| ())
            .map_err(Error::Serve)
    }
}

/// How long open requests may finish after the shutdown.
const GRACE: Duration = Duration::from_secs(1);

/// Binds the Unix socket at `path` for the pods: its folder is made, a socket
/// left by an earlier run is replaced, and anyone may connect (a pod's
/// processes run as any user; the token and the cgroup check decide).
pub fn bind_socket(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ));
        }
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))?;
    Ok(listener)
}

/// A hypervisor serving on a runtime of its own: for tests and embedding.
/// Dropping it stops the server (regions stay).
pub struct RunningHypervisor {
    pub(crate) addr: SocketAddr,
    pub(crate) hypervisor: Hypervisor,
    pub(crate) stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub(crate) runtime: Option<tokio::runtime::Runtime>,
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
            let listener =
                crate::conn::bind_tcp(addr).map_err(|source| Error::Listen { addr, source })?;
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
