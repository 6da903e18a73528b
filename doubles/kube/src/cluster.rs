//! What the rest of a cluster would write to the fake API server, through
//! the API like them, for the device plugin's tests: a node, and pods bound
//! to it written for HAMi. Claims are never allocated here: the DRA tests
//! run on the official control plane, whose scheduler allocates them.

use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, PostParams};
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
