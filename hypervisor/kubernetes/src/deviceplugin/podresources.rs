//! The kubelet's pod-resources API (`v1` `List`): which containers of which
//! pods hold which devices. The kubelet records a container's devices after
//! its `Allocate` answer, so at `Allocate` it tells which pods the kubelet is
//! admitting and which containers are already served, and at
//! `PreStartContainer` exactly which container got the devices.

use std::path::Path;

use super::pb::podresources::pod_resources_lister_client::PodResourcesListerClient;
use super::pb::podresources::{ListPodResourcesRequest, PodResources};
use crate::dra::socket;

/// Why the list could not be had.
#[derive(Debug, thiserror::Error)]
pub enum PodResourcesError {
    /// The socket is there but takes no connection (the kubelet
    /// restarting, for one).
    #[error("cannot connect to {path}: {source}")]
    Connect {
        /// The kubelet's pod-resources socket.
        path: String,
        /// tonic's reason.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet answered `List` with an error.
    #[error("pod-resources List: {0}")]
    Rpc(#[from] tonic::Status),
}

/// The pods the kubelet at `path` has; `Ok(None)` when there is no socket.
pub async fn list(path: &Path) -> Result<Option<Vec<PodResources>>, PodResourcesError> {
    if !path.exists() {
        return Ok(None);
    }
    let channel = socket::connect(path)
        .await
        .map_err(|source| PodResourcesError::Connect {
            path: path.display().to_string(),
            source,
        })?;
    let answer = PodResourcesListerClient::new(channel)
        .list(ListPodResourcesRequest {})
        .await?;
    Ok(Some(answer.into_inner().pod_resources))
}

/// The (namespace, pod, container) holding exactly `devices` of `resource`.
pub fn holder<'a>(
    pods: &'a [PodResources],
    resource: &str,
    devices: &[String],
) -> Option<(&'a str, &'a str, &'a str)> {
    let mut wanted = devices.to_vec();
    wanted.sort();
    pods.iter().find_map(|pod| {
        pod.containers.iter().find_map(|c| {
            let mut held: Vec<String> = c
                .devices
                .iter()
                .filter(|d| d.resource_name == resource)
                .flat_map(|d| d.device_ids.clone())
                .collect();
            held.sort();
            (!held.is_empty() && held == wanted).then_some((
                pod.namespace.as_str(),
                pod.name.as_str(),
                c.name.as_str(),
            ))
        })
    })
}

/// Whether container `container` of pod `namespace/name` holds devices of `resource`.
pub fn served(
    pods: &[PodResources],
    resource: &str,
    namespace: &str,
    name: &str,
    container: &str,
) -> bool {
    pods.iter()
        .filter(|p| p.namespace == namespace && p.name == name)
        .flat_map(|p| &p.containers)
        .filter(|c| c.name == container)
        .flat_map(|c| &c.devices)
        .any(|d| d.resource_name == resource && !d.device_ids.is_empty())
}
