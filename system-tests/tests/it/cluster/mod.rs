//! The node agent end to end on the official control plane (API server,
//! scheduler, controller manager): DRA claims allocated by the real
//! scheduler and prepared by the agent, the device plugin's placement and
//! health, co-run GPUs, overcommit, claims shared by several pods, the
//! admission policies that check claims and device-plugin pods when they
//! are written, and a claim the node refuses when it prepares it.
//!
//! Every test of the binary shares one control plane (`deploy/` installed
//! once, stopped when the binary exits), each in a namespace and on a Node
//! of its own ([`Tenant`], deleted when the test ends): its claims in its
//! namespace, its pods pinned to its Node, which only its own agent serves.

use std::path::{Path, PathBuf};

use hypervisor_daemon::Hypervisor;
use hypervisor_kubernetes::deviceplugin::DevicePluginConfig;
use kube_fakes::device_kubelet::FakeDeviceKubelet;
use kube_fakes::tenant::Tenant;
use serde_json::Value;

mod agent_process;
mod agent_restart;
mod claim_parameters;
mod claim_refusal;
mod claim_validation;
mod corun_provision;
mod device_health;
mod device_plugin;
mod kubernetes;
mod overcommit;
mod pod_validation;
mod shared_claims;
mod tenant_cleanup;

/// The DRA driver's name, the shipped DeviceClass's.
pub(crate) const DRIVER: &str = "gpu.gpushare.dev";

/// The runtime a test runs its node and its clients on.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A namespace and a Node of their own, named after `tag`, on the shared
/// control plane.
pub(crate) async fn tenant(tag: &str) -> Tenant {
    let name = system_tests::unique::name(tag);
    Tenant::new(&name).await.unwrap_or_else(|e| panic!("{e:#}"))
}

/// Pod `pod` as the hypervisor's status shows it (JSON), if it holds it.
pub(crate) fn pod_status(hv: &Hypervisor, pod: &str) -> Option<Value> {
    let status = serde_json::to_value(hv.status()).unwrap();
    status["pods"]
        .as_array()?
        .iter()
        .find(|p| p["id"] == pod)
        .cloned()
}

/// Where the agent whose folders are under `dir` ([`kube_fakes::node::options`])
/// writes the CDI spec of claim `claim_uid`.
pub(crate) fn spec_path(dir: &Path, claim_uid: &str) -> PathBuf {
    dir.join("cdi")
        .join(format!("gpushare.dev-gpu_{claim_uid}.json"))
}

/// The device plugin's options, its kubelet's folders under `kubelet`,
/// `shares` per GPU, and the device-plugin kubelet double started there
/// (on the caller's runtime), serving the pod-resources list with
/// `pod_resources`.
pub(crate) fn device_plugin_kubelet(
    kubelet: &Path,
    shares: u32,
    pod_resources: bool,
) -> (DevicePluginConfig, FakeDeviceKubelet) {
    let mut config = DevicePluginConfig::under(kubelet, shares);
    if !pod_resources {
        config.pod_resources = kubelet.join("no-pod-resources.sock");
    }
    std::fs::create_dir_all(&config.dir).unwrap();
    let served = pod_resources.then_some(config.pod_resources.as_path());
    let double = FakeDeviceKubelet::start(&config.dir, served).unwrap();
    (config, double)
}
