//! Serving the hypervisor over HTTP: its routes ([`crate::api`]) and its
//! background tasks, on listeners of the caller's (TCP, the pods' Unix
//! socket, a metrics-only one).

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use crate::api::Audience;
use crate::conn::{GuardedAcceptor, Listener};
use crate::{Error, Hypervisor};

/// Where the daemon answers.
#[derive(Debug, Default)]
pub struct Listeners {
    /// The whole API: TCP (`--listen`) and the pods' Unix socket (`--socket`).
    pub api: Vec<Listener>,
    /// `/metrics`, `/healthz` and `/readyz` alone (`--metrics-listen`).
    pub metrics: Option<Listener>,
}

impl Hypervisor {
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
            let app = crate::api::router(self, audience);
            servers.push(
                poem::Server::new_with_acceptor(acceptor)
                    .run_with_graceful_shutdown(app, shutdown.clone(), Some(GRACE))
                    .boxed(),
            );
        }
        if let Some(listener) = listeners.metrics {
            let acceptor = GuardedAcceptor::new(listener, limits).map_err(Error::Serve)?;
            let app = crate::api::router(self, Audience::Metrics);
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
