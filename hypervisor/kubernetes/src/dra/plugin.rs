//! `DRAPlugin` (v1, v1beta1, and v1beta1 under its older package name):
//! every claim of a request is prepared (or unprepared) on its own, its
//! failure reported in its own entry, as the kubelet expects.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use gpushare_utils::logging::one_line;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;

use super::pb::registration::registration_server::RegistrationServer;
use super::registration::RegistrationService;
use super::{ClaimPreparer, ClaimRef, PreparedDevice, pb, socket};
pub use crate::options::PluginSockets;

/// The service for one protocol version, over a shared preparer.
pub struct DraService<P> {
    preparer: Arc<P>,
}

impl<P> DraService<P> {
    /// A service that hands each claim to `preparer`, which the services
    /// of every version share.
    pub fn new(preparer: Arc<P>) -> Self {
        Self { preparer }
    }
}

impl<P> Clone for DraService<P> {
    fn clone(&self) -> Self {
        Self {
            preparer: Arc::clone(&self.preparer),
        }
    }
}

/// Implements one version's generated trait; the messages are the same in
/// every version, in different modules.
macro_rules! dra_version {
    ($pb:path) => {
        const _: () = {
            use v::dra_plugin_server::DraPlugin;
            use $pb as v;

            #[tonic::async_trait]
            impl<P: ClaimPreparer> DraPlugin for DraService<P> {
                async fn node_prepare_resources(
                    &self,
                    request: tonic::Request<v::NodePrepareResourcesRequest>,
                ) -> Result<tonic::Response<v::NodePrepareResourcesResponse>, tonic::Status>
                {
                    let mut claims = HashMap::new();
                    for claim in request.into_inner().claims {
                        let uid = claim.uid.clone();
                        let answer = match self
                            .preparer
                            .prepare(claim_ref(claim.namespace, claim.uid, claim.name))
                            .await
                        {
                            Ok(devices) => v::NodePrepareResourceResponse {
                                devices: devices
                                    .into_iter()
                                    .map(|d: PreparedDevice| v::Device {
                                        request_names: d.request_names,
                                        pool_name: d.pool_name,
                                        device_name: d.device_name,
                                        cdi_device_ids: d.cdi_device_ids,
                                    })
                                    .collect(),
                                error: String::new(),
                            },
                            Err(refused) => {
                                let error = one_line(&refused);
                                tracing::debug!(claim = uid, error, "prepare failed");
                                v::NodePrepareResourceResponse {
                                    devices: Vec::new(),
                                    error,
                                }
                            }
                        };
                        claims.insert(uid, answer);
                    }
                    Ok(tonic::Response::new(v::NodePrepareResourcesResponse {
                        claims,
                    }))
                }

                async fn node_unprepare_resources(
                    &self,
                    request: tonic::Request<v::NodeUnprepareResourcesRequest>,
                ) -> Result<tonic::Response<v::NodeUnprepareResourcesResponse>, tonic::Status>
                {
                    let mut claims = HashMap::new();
                    for claim in request.into_inner().claims {
                        let uid = claim.uid.clone();
                        let error = match self
                            .preparer
                            .unprepare(claim_ref(claim.namespace, claim.uid, claim.name))
                            .await
                        {
                            Ok(()) => String::new(),
                            Err(refused) => {
                                let error = one_line(&refused);
                                tracing::warn!(claim = uid, error, "unprepare failed");
                                error
                            }
                        };
                        claims.insert(uid, v::NodeUnprepareResourceResponse { error });
                    }
                    Ok(tonic::Response::new(v::NodeUnprepareResourcesResponse {
                        claims,
                    }))
                }
            }
        };
    };
}

dra_version!(pb::v1);
dra_version!(pb::v1beta1);
dra_version!(pb::v1beta1_legacy);

fn claim_ref(namespace: String, uid: String, name: String) -> ClaimRef {
    ClaimRef {
        namespace,
        uid,
        name,
    }
}

/// Serves `DRAPlugin` and the registration until `shutdown`; the sockets
/// are removed at the end (the kubelet then forgets the plugin).
pub async fn serve<P: ClaimPreparer>(
    driver: &str,
    sockets: &PluginSockets,
    preparer: Arc<P>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let service = DraService::new(preparer);
    let plugin_listener = socket::bind(&sockets.plugin)?;
    let registration_listener = socket::bind(&sockets.registration)?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let plugin = Server::builder()
        .add_service(pb::v1::dra_plugin_server::DraPluginServer::new(
            service.clone(),
        ))
        .add_service(pb::v1beta1::dra_plugin_server::DraPluginServer::new(
            service.clone(),
        ))
        .add_service(pb::v1beta1_legacy::dra_plugin_server::DraPluginServer::new(
            service,
        ))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(plugin_listener),
            wait(stopped.clone()),
        );
    // Registered last: the kubelet may call the plugin as soon as it sees this.
    let registration = Server::builder()
        .add_service(RegistrationServer::new(RegistrationService::new(
            driver,
            sockets.plugin.clone(),
        )))
        .serve_with_incoming_shutdown(
            UnixListenerStream::new(registration_listener),
            wait(stopped),
        );
    tokio::spawn(async move {
        shutdown.await;
        let _ = stop.send(true);
    });
    let (a, b) = tokio::join!(plugin, registration);
    for path in [&sockets.registration, &sockets.plugin] {
        let _ = std::fs::remove_file(path);
    }
    a.and(b).map_err(std::io::Error::other)
}

async fn wait(mut stopped: tokio::sync::watch::Receiver<bool>) {
    let _ = stopped.wait_for(|s| *s).await;
}
