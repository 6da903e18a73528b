//! What a user writes for the device plugin's tests, through the API: pods
//! written for HAMi, bound to the node by name (no kubelet here advertises
//! `nvidia.com/gpu` to the scheduler). Claims are never allocated here: the
//! scheduler of the official control plane allocates them.

use k8s_openapi::api::core::v1::Pod;
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
