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

/// Which of `deploy/`'s kustomizations an administrator applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlay {
    /// `deploy/base`: DRA.
    Base,
    /// `deploy/device-plugin`: the base and the device plugin's rights.
    DevicePlugin,
}

impl Overlay {
    /// Its folder.
    pub fn dir(self) -> PathBuf {
        deploy_dir().join(match self {
            Overlay::Base => "base",
            Overlay::DevicePlugin => "device-plugin",
        })
    }
}

/// `kubectl apply -k` of `overlay` with `kubectl` (an administrator's);
/// what it printed.
pub fn install(kubectl: &Kubectl, overlay: Overlay) -> anyhow::Result<String> {
    let dir = overlay.dir();
    let dir = dir.to_str().context("deploy/ path")?;
    Ok(kubectl.ok(&["apply", "-k", dir], None)?)
}

/// The official control plane with `overlay` installed by `kubectl` as an
/// administrator does (kubectl's home in `home`), and a kubeconfig at
/// `agent` with a token of the node agent's ServiceAccount. Start it from
/// the test's own thread (see [`ControlPlane::start`]). A test that can
/// share the control plane takes a [`Tenant`](crate::tenant::Tenant) of the
/// shared one instead.
pub async fn installed(
    overlay: Overlay,
    home: &Path,
    agent: &Path,
) -> anyhow::Result<ControlPlane> {
    let plane = ControlPlane::start().await?;
    install(&Kubectl::new(plane.admin_kubeconfig(), home), overlay)?;
    agent_kubeconfig(&plane, AGENT_ACCOUNT.1, agent).await?;
    Ok(plane)
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

/// Node `name` registered by its kubelet (with `gpu_labels`), as before
/// any DaemonSet pod runs there; a client with the kubelet's credentials.
pub async fn register_node(plane: &ControlPlane, name: &str) -> anyhow::Result<kube::Client> {
    let client = kube_control_plane::client(&plane.node_kubeconfig(name)?).await?;
    node_kubelet::register(&client, name, gpu_labels()).await?;
    Ok(client)
}

/// Waits (up to 90 s) until Node `name` has no taints. The API server taints
/// a new Node `node.kubernetes.io/not-ready`, which the node lifecycle
/// controller takes off once it sees the Node Ready: a pod scheduled before
/// then is refused for the taint, not for what the test asks of the
/// scheduler. On a loaded machine the controller can be seconds late.
pub async fn schedulable(client: &kube::Client, name: &str) -> anyhow::Result<()> {
    let nodes = kube::Api::<k8s_openapi::api::core::v1::Node>::all(client.clone());
    let mut taints = Vec::new();
    for _ in 0..900 {
        let node = nodes.get(name).await.context("the Node")?;
        taints = node.spec.and_then(|s| s.taints).unwrap_or_default();
        if taints.is_empty() {
            return Ok(());
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    anyhow::bail!("Node {name} still tainted: {taints:?}")
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
        let client = register_node(plane, &name).await?;
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
