//! What the rest of a cluster would write, through the API like them: a
//! node, pods bound to it, claims asking for a GPU fraction, and the
//! scheduler's allocation of a claim (consumed capacity, reservation).

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::{Value, json};

/// Why a write failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error(transparent)]
    Api(#[from] kube::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

type Result<T> = std::result::Result<T, ClusterError>;

/// Creates node `name`.
pub async fn create_node(client: &kube::Client, name: &str) -> Result<Node> {
    let node: Node = serde_json::from_value(json!({"metadata": {"name": name}}))?;
    Api::<Node>::all(client.clone())
        .create(&PostParams::default(), &node)
        .await
        .map_err(Into::into)
}

/// Creates a running pod bound to `node` that uses claim `claim`.
pub async fn create_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    node: &str,
    claim: &str,
) -> Result<Pod> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
    }))?;
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    pods.create(&PostParams::default(), &pod).await?;
    // A create leaves the status as the server sets it; the kubelet writes it.
    let status = json!({"status": {"phase": "Running", "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}});
    pods.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(Into::into)
}

/// Creates claim `name` asking for one GPU of `class` with `memory` and
/// `compute` (quantities), and `parameters` as its opaque configuration.
pub async fn create_claim(
    client: &kube::Client,
    ns: &str,
    name: &str,
    class: &str,
    memory: &str,
    compute: &str,
    parameters: Option<Value>,
) -> Result<ResourceClaim> {
    let mut spec = json!({"devices": {"requests": [{"name": "gpu", "exactly": {
        "deviceClassName": class,
        "capacity": {"requests": {"memory": memory, "compute": compute}},
    }}]}});
    if let Some(parameters) = parameters {
        spec["devices"]["config"] =
            json!([{"requests": ["gpu"], "opaque": {"driver": class, "parameters": parameters}}]);
    }
    let claim: ResourceClaim =
        serde_json::from_value(json!({"metadata": {"name": name, "namespace": ns}, "spec": spec}))?;
    Api::<ResourceClaim>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &claim)
        .await
        .map_err(Into::into)
}

/// Allocates `claim` on device `device` of `node`'s pool as the scheduler
/// does with consumable capacity: the result with its consumed capacity
/// and share ID, the claim's configs copied, the pod in `reservedFor`.
pub async fn allocate(
    client: &kube::Client,
    claim: &ResourceClaim,
    pod: &Pod,
    driver: &str,
    node: &str,
    device: &str,
) -> Result<ResourceClaim> {
    let ns = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let exact = claim
        .spec
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .and_then(|d| d.requests.as_ref())
        .and_then(|r| r.first())
        .and_then(|r| r.exactly.as_ref());
    let consumed = exact
        .and_then(|e| e.capacity.as_ref())
        .and_then(|c| c.requests.clone())
        .unwrap_or_default();
    let config: Vec<Value> = claim
        .spec
        .as_ref()
        .and_then(|s| s.devices.as_ref())
        .and_then(|d| d.config.clone())
        .unwrap_or_default()
        .into_iter()
        .map(|c| json!({"source": "FromClaim", "requests": c.requests, "opaque": c.opaque}))
        .collect();
    let uid = claim.metadata.uid.clone().unwrap_or_default();
    let status = json!({"status": {
        "allocation": {
            "devices": {
                "results": [{
                    "request": "gpu", "driver": driver, "pool": node, "device": device,
                    "consumedCapacity": consumed, "shareID": format!("{:0>8}", &uid[uid.len().saturating_sub(8)..]),
                }],
                "config": config,
            },
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        },
        "reservedFor": [{"resource": "pods", "name": pod.metadata.name, "uid": pod.metadata.uid}],
    }});
    Api::<ResourceClaim>::namespaced(client.clone(), &ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(Into::into)
}

/// Creates pod `name` bound to `node`, pending (its containers not started),
/// whose container `main` has `limits` (HAMi's resource names) and whose
/// metadata has `annotations`.
pub async fn create_gpu_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    node: &str,
    limits: Value,
    annotations: Value,
) -> Result<Pod> {
    let pod: Pod = serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}],
        },
    }))?;
    Api::<Pod>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &pod)
        .await
        .map_err(Into::into)
}
