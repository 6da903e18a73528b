//! Serving `DevicePlugin` in the kubelet's `device-plugins` folder and
//! registering it with the kubelet's `Registration` (`kubelet.sock` there),
//! one socket per resource. A kubelet that restarts empties the folder: the
//! socket gone, the plugin serves and registers again.

use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use super::pb::v1beta1::RegisterRequest;
use super::pb::v1beta1::device_plugin_server::DevicePluginServer;
use super::pb::v1beta1::registration_client::RegistrationClient;
use super::service::{DevicePluginService, options};
use super::{API_VERSION, Allocator, DevicePluginConfig, DevicePluginError, GpuHealth};
use crate::dra::socket;

/// The kubelet's registration socket in the device-plugins folder.
pub const KUBELET_SOCKET: &str = "kubelet.sock";
/// How often the socket is checked and a refused registration retried.
const POLL: Duration = Duration::from_millis(500);

/// Serves every resource of `config` until `shutdown`; the sockets are
/// removed at the end.
pub async fn serve<A: Allocator>(
    config: DevicePluginConfig,
    allocator: Arc<A>,
    gpus: watch::Receiver<Vec<GpuHealth>>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), DevicePluginError> {
    let (stop, stopped) = watch::channel(false);
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let tasks: Vec<_> = config
        .resources
        .iter()
        .map(|resource| {
            let service = DevicePluginService::new(
                resource,
                config.shares_per_gpu,
                Arc::clone(&allocator),
                gpus.clone(),
            );
            tokio::spawn(serve_one(
                config.dir.clone(),
                resource.clone(),
                service,
                stopped.clone(),
            ))
        })
        .collect();
    let mut result = Ok(());
    for task in tasks {
        match task.await {
            Ok(Err(error)) if result.is_ok() => result = Err(error),
            Err(join) if result.is_ok() => {
                result = Err(DevicePluginError::Socket {
                    path: config.dir.clone(),
                    source: std::io::Error::other(join),
                });
            }
            _ => {}
        }
    }
    result
}

async fn serve_one<A: Allocator>(
    dir: std::path::PathBuf,
    resource: String,
    service: DevicePluginService<A>,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), DevicePluginError> {
    let endpoint = DevicePluginConfig::endpoint(&resource);
    let path = dir.join(&endpoint);
    let service = Arc::new(service);
    while !*stopped.borrow() {
        let listener = socket::bind(&path).map_err(|source| DevicePluginError::Socket {
            path: path.clone(),
            source,
        })?;
        let inode = std::fs::metadata(&path).map(|m| m.ino()).ok();
        let (halt, halted) = watch::channel(false);
        let server = tokio::spawn(
            Server::builder()
                .add_service(DevicePluginServer::from_arc(Arc::clone(&service)))
                .serve_with_incoming_shutdown(UnixListenerStream::new(listener), async move {
                    let mut halted = halted;
                    let _ = halted.wait_for(|h| *h).await;
                }),
        );
        let mut registered = false;
        loop {
            if !registered {
                match register(&dir, &endpoint, &resource).await {
                    Ok(()) => {
                        tracing::info!(
                            resource,
                            endpoint,
                            "device plugin registered with the kubelet"
                        );
                        registered = true;
                    }
                    Err(error) => tracing::warn!(%error, "device plugin not registered yet"),
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(POLL) => {}
                _ = stopped.wait_for(|s| *s) => break,
            }
            // The kubelet restarted: our socket was removed (or replaced).
            if std::fs::metadata(&path).map(|m| m.ino()).ok() != inode {
                tracing::warn!(
                    resource,
                    "device plugin socket gone: serving and registering again"
                );
                break;
            }
        }
        let _ = halt.send(true);
        if let Ok(Err(error)) = server.await {
            tracing::error!(%error, resource, "device plugin server");
        }
    }
    let _ = std::fs::remove_file(&path);
    Ok(())
}

/// Registers `endpoint` (a socket name in `dir`) for `resource`.
pub async fn register(dir: &Path, endpoint: &str, resource: &str) -> Result<(), DevicePluginError> {
    let kubelet = dir.join(KUBELET_SOCKET);
    let channel = socket::connect(&kubelet)
        .await
        .map_err(|source| DevicePluginError::Connect {
            path: kubelet.clone(),
            source,
        })?;
    RegistrationClient::new(channel)
        .register(RegisterRequest {
            version: API_VERSION.to_owned(),
            endpoint: endpoint.to_owned(),
            resource_name: resource.to_owned(),
            options: Some(options()),
        })
        .await
        .map_err(|status| DevicePluginError::Register {
            resource: resource.to_owned(),
            status,
        })?;
    Ok(())
}
