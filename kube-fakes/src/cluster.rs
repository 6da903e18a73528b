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

/// Creates `object` (JSON) through `api`.
async fn create<K>(api: Api<K>, object: Value) -> Result<K>
where
    K: Clone + std::fmt::Debug,
    K: k8s_openapi::serde::Serialize + k8s_openapi::serde::de::DeserializeOwned,
{
    let object: K = serde_json::from_value(object)?;
    api.create(&PostParams::default(), &object)
        .await
        .map_err(Into::into)
}

/// Creates node `name`.
pub async fn create_node(client: &kube::Client, name: &str) -> Result<Node> {
    create(
        Api::<Node>::all(client.clone()),
        json!({"metadata": {"name": name}}),
    )
    .await
}

/// Creates a running pod bound to `node` that uses claim `claim`.
pub async fn create_pod(
    client: &kube::Client,
    ns: &str,
    name: &str,
    node: &str,
    claim: &str,
) -> Result<Pod> {
    let pods = Api::<Pod>::namespaced(client.clone(), ns);
    create(pods.clone(), json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "cuda", "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": claim}],
        },
    }))
    .await?;
    // A create leaves the status as the server sets it; the kubelet writes it.
    pods.patch_status(
        name,
        &PatchParams::default(),
        &Patch::Merge(&running(claim)),
    )
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
    let claim = json!({"metadata": {"name": name, "namespace": ns}, "spec": spec});
    create(Api::<ResourceClaim>::namespaced(client.clone(), ns), claim).await
}

/// Allocates `claim` on device `device` of `node`'s pool as the scheduler
/// does with consumable capacity (see [`allocation`]).
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
    let status = allocation(
        &serde_json::to_value(claim)?,
        &serde_json::to_value(pod)?,
        driver,
        node,
        device,
    );
    Api::<ResourceClaim>::namespaced(client.clone(), &ns)
        .patch_status(&name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .map_err(Into::into)
}

/// The merge patch of `claim`'s status (JSON, as stored) with which the
/// scheduler allocates it on device `device` of `node`'s pool with
/// consumable capacity: one result per request with its consumed capacity
/// (what the request asks) and a share ID (a UUID, as the API server
/// requires), the claim's configs copied, `pod` (JSON) in `reservedFor`.
pub fn allocation(claim: &Value, pod: &Value, driver: &str, node: &str, device: &str) -> Value {
    let spec = &claim["spec"]["devices"];
    let uid = claim["metadata"]["uid"].as_str().unwrap_or_default();
    let tail: String = uid.chars().filter(char::is_ascii_hexdigit).collect();
    let share = format!(
        "00000000-0000-4000-8000-{:0>12}",
        &tail[tail.len().saturating_sub(12)..]
    );
    let results: Vec<Value> = spec["requests"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|request| {
            json!({
                "request": request["name"], "driver": driver, "pool": node, "device": device,
                "consumedCapacity": request["exactly"]["capacity"]["requests"],
                "shareID": share,
            })
        })
        .collect();
    let config: Vec<Value> = spec["config"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| json!({"source": "FromClaim", "requests": c["requests"], "opaque": c["opaque"]}))
        .collect();
    json!({"status": {
        "allocation": {
            "devices": {"results": results, "config": config},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node]}]}]},
        },
        "reservedFor": [{"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}],
    }})
}

/// The merge patch of a pod's status with which its kubelet reports it
/// running, its claim `gpu` being `claim`.
pub fn running(claim: &str) -> Value {
    json!({"status": {"phase": "Running", "resourceClaimStatuses": [{"name": "gpu", "resourceClaimName": claim}]}})
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
    let pod = json!({
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": limits}}],
        },
    });
    create(Api::<Pod>::namespaced(client.clone(), ns), pod).await
}
