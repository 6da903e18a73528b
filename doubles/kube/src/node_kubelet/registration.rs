//! The node's own object: created as a kubelet registers it, and reported
//! Ready with room for pods at every heartbeat.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use serde_json::json;

use super::now_seconds;

/// Creates Node `node` (with `labels`) as its kubelet registers it, then
/// reports it Ready with room for pods.
pub async fn register(
    client: &kube::Client,
    node: &str,
    mut labels: BTreeMap<String, String>,
) -> Result<(), kube::Error> {
    let nodes = Api::<Node>::all(client.clone());
    labels.insert("kubernetes.io/hostname".to_owned(), node.to_owned());
    labels.insert("kubernetes.io/os".to_owned(), "linux".to_owned());
    let object = Node {
        metadata: ObjectMeta {
            name: Some(node.to_owned()),
            labels: Some(labels),
            ..ObjectMeta::default()
        },
        ..Node::default()
    };
    if nodes.get_opt(node).await?.is_none() {
        nodes.create(&PostParams::default(), &object).await?;
    }
    report_ready(&nodes, node).await
}

/// Reports Node `node` Ready, with room for pods (its heartbeat too).
pub(super) async fn report_ready(nodes: &Api<Node>, node: &str) -> Result<(), kube::Error> {
    let now = now_seconds();
    let room = json!({"cpu": "16", "memory": "64Gi", "pods": "110"});
    let status = json!({"status": {
        "capacity": room, "allocatable": room,
        "addresses": [{"type": "InternalIP", "address": "127.0.0.1"}, {"type": "Hostname", "address": node}],
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
            "message": "kubelet is posting ready status",
            "lastHeartbeatTime": now, "lastTransitionTime": now}],
    }});
    nodes
        .patch_status(node, &PatchParams::default(), &Patch::Strategic(&status))
        .await
        .map(drop)
}
