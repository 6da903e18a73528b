//! A node of a real cluster (the official control plane of
//! `kube-control-plane`): `deploy/base` installed by `kubectl` as an
//! administrator does, the Node registered by its kubelet, the product's
//! node (hypervisor and agent) on a token of the shipped ServiceAccount,
//! and the kubelet running the pods the scheduler binds there.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Context;
use hypervisor_corun::CorunOptions;
use hypervisor_kubernetes::AgentOptions;
use hypervisor_observer::GpuObserver;
use kube_control_plane::ControlPlane;
use serde_json::{Value, json};

use crate::clients::Kubectl;
use crate::node::TestNode;
use crate::node_kubelet::{self, NodeKubelet};

/// The node agent's ServiceAccount in `deploy/base`: (namespace, name).
pub const AGENT_ACCOUNT: (&str, &str) = ("gpushare-system", "gpushare-node");

/// `deploy/` of this repository.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// `kubectl apply -k deploy/base` with `kubectl` (an administrator's);
/// what it printed.
pub fn install(kubectl: &Kubectl) -> anyhow::Result<String> {
    let base = deploy_dir().join("base");
    let base = base.to_str().context("deploy/ path")?;
    Ok(kubectl.ok(&["apply", "-k", base], None)?)
}

/// A kubeconfig at `path` with a token of ServiceAccount `account` of the
/// agent's namespace, as the DaemonSet's pod gets one.
pub async fn agent_kubeconfig(
    plane: &ControlPlane,
    account: &str,
    path: &Path,
) -> anyhow::Result<()> {
    plane
        .service_account_kubeconfig(AGENT_ACCOUNT.0, account, path)
        .await?;
    Ok(())
}

/// The labels of a GPU node (GPU feature discovery sets this one), which
/// the shipped DaemonSet selects.
pub fn gpu_labels() -> BTreeMap<String, String> {
    BTreeMap::from([("nvidia.com/gpu.present".to_owned(), "true".to_owned())])
}

/// A running node of the cluster: its kubelet and the product's node.
pub struct ClusterNode {
    /// The kubelet (stopped first when dropped).
    pub kubelet: NodeKubelet,
    /// The product's node: hypervisor, agent, plugin.
    pub node: TestNode,
}

impl ClusterNode {
    /// The kubelet registers Node `options.node` (as it does before any
    /// DaemonSet pod runs), the product's node starts with its agent on
    /// `options` (whose kubeconfig is written), and the kubelet runs the
    /// pods bound to it with the plugin the agent registered.
    pub async fn start(
        plane: &ControlPlane,
        observer: Arc<dyn GpuObserver>,
        options: AgentOptions,
        corun: Option<CorunOptions>,
    ) -> anyhow::Result<Self> {
        let name = options.node.clone();
        let kubeconfig = plane.node_kubeconfig(&name)?;
        let client = kube_control_plane::client(&kubeconfig).await?;
        node_kubelet::register(&client, &name, gpu_labels()).await?;
        let node = TestNode::start_written(observer, options, corun).await?;
        let kubelet = NodeKubelet::start(client, &name, gpu_labels(), node.kubelet.clone()).await?;
        Ok(Self { kubelet, node })
    }

    /// Stops the kubelet, then the product's node.
    pub async fn stop(self) {
        drop(self.kubelet);
        self.node.stop().await;
    }
}

/// A claim `name` whose request `gpu` asks `count` devices of `class`, each
/// with `memory` and `compute` (quantities), on the device with index
/// `index` alone when given (a CEL selector on its `index` attribute),
/// with `parameters` as its opaque configuration: the object, as JSON.
pub fn claim(
    name: &str,
    class: &str,
    count: usize,
    (memory, compute): (&str, &str),
    index: Option<u32>,
    parameters: Option<Value>,
) -> Value {
    let mut exactly = json!({
        "deviceClassName": class,
        "allocationMode": "ExactCount",
        "count": count,
        "capacity": {"requests": {"memory": memory, "compute": compute}},
    });
    if let Some(index) = index {
        exactly["selectors"] = json!([{"cel": {
            "expression": format!("device.attributes[\"{class}\"].index == {index}"),
        }}]);
    }
    let mut spec = json!({"devices": {"requests": [{"name": "gpu", "exactly": exactly}]}});
    if let Some(parameters) = parameters {
        spec["devices"]["config"] =
            json!([{"requests": ["gpu"], "opaque": {"driver": class, "parameters": parameters}}]);
    }
    json!({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name}, "spec": spec})
}

/// A pod `name` for node `node` whose container uses the claims `claims`
/// (by name): the object, as JSON. The scheduler binds it.
pub fn pod(name: &str, node: &str, claims: &[&str]) -> Value {
    let uses: Vec<Value> = claims.iter().map(|c| json!({"name": c})).collect();
    let sources: Vec<Value> = claims
        .iter()
        .map(|c| json!({"name": c, "resourceClaimName": c}))
        .collect();
    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
    "spec": {
        "nodeSelector": {"kubernetes.io/hostname": node},
        "containers": [{"name": "main", "image": "cuda", "resources": {"claims": uses}}],
        "resourceClaims": sources,
    }})
}
