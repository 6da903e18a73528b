//! What a test of the official control plane waits for before it asks the
//! scheduler for anything.

use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::Api;

/// Waits (up to 90 s) until Node `name` has no taints. The API server taints
/// a new Node `node.kubernetes.io/not-ready`, which the node lifecycle
/// controller takes off once it sees the Node Ready: a pod scheduled before
/// then is refused for the taint, not for what the test asks of the
/// scheduler. On a loaded machine (the other tests of this binary run
/// beside it) the controller can be seconds late.
pub(crate) async fn schedulable(client: &kube::Client, name: &str) {
    let nodes = Api::<Node>::all(client.clone());
    let mut taints = Vec::new();
    for _ in 0..900 {
        let node = nodes.get(name).await.expect("the Node");
        taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
        if taints.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("Node {name} still tainted: {taints:?}");
}
