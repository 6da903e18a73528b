//! Serving the hypervisor over HTTP: its routes ([`crate::api`]) and its
//! background tasks, on a listener of the caller's or on a runtime of its own.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use crate::daemon::{Error, Hypervisor, Options};

impl Hypervisor {
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
