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
    /// The API server refused it, or could not be reached.
    #[error(transparent)]
    Api(#[from] kube::Error),
    /// An object could not be built or read as JSON.
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
    create_claim_for_gpus(client, ns, name, class, 1, (memory, compute), parameters).await
}

/// Creates claim `name` whose one request asks for `count` GPUs of `class`,
/// each with `capacity` (memory and compute quantities), and `parameters`
/// as its opaque configuration.
pub async fn create_claim_for_gpus(
    client: &kube::Client,
    ns: &str,
    name: &str,
    class: &str,
    count: usize,
    (memory, compute): (&str, &str),
    parameters: Option<Value>,
) -> Result<ResourceClaim> {
    let mut exactly = json!({
        "deviceClassName": class,
        "capacity": {"requests": {"memory": memory, "compute": compute}},
    });
    if count > 1 {
        exactly["allocationMode"] = json!("ExactCount");
        exactly["count"] = json!(count);
    }
    let mut spec = json!({"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}});
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
    allocate_on(client, claim, pod, driver, node, &[device]).await
}

/// Allocates each request of `claim` on every device of `devices` (a
/// request for as many GPUs) of `node`'s pool (see [`allocation_on`]).
pub async fn allocate_on(
    client: &kube::Client,
    claim: &ResourceClaim,
    pod: &Pod,
    driver: &str,
    node: &str,
    devices: &[&str],
) -> Result<ResourceClaim> {
    let ns = claim.metadata.namespace.clone().unwrap_or_default();
    let name = claim.metadata.name.clone().unwrap_or_default();
    let status = allocation_on(
        &serde_json::to_value(claim)?,
        &serde_json::to_value(pod)?,
        driver,
        node,
        devices,
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
    allocation_on(claim, pod, driver, node, &[device])
}

/// [`allocation`] with each request on every device of `devices`: one
/// result per request and device, each share with an ID of its own.
pub fn allocation_on(
    claim: &Value,
    pod: &Value,
    driver: &str,
    node: &str,
    devices: &[&str],
) -> Value {
    let spec = &claim["spec"]["devices"];
    let uid = claim["metadata"]["uid"].as_str().unwrap_or_default();
    let tail: String = uid.chars().filter(char::is_ascii_hexdigit).collect();
    let tail = &tail[tail.len().saturating_sub(12)..];
    // The claim's tail, its last digits replaced by the device's position
    // where there are several.
    let share = |i: usize| {
        let id = if devices.len() > 1 {
            let kept = tail.len().saturating_sub(2);
            format!("{}{i:02x}", &tail[..kept])
        } else {
            tail.to_owned()
        };
        format!("00000000-0000-4000-8000-{id:0>12}")
    };
    let results: Vec<Value> = spec["requests"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|request| {
            devices.iter().enumerate().map(move |(i, device)| {
                json!({
                    "request": request["name"], "driver": driver, "pool": node, "device": device,
                    "consumedCapacity": request["exactly"]["capacity"]["requests"],
                    "shareID": share(i),
                })
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
