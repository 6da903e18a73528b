//! How the node agent runs: its options, and the plain types of each mode
//! that the agent's shared state holds (so neither mode's folder is below
//! the state and above it at once).

use std::path::{Path, PathBuf};
use std::time::Duration;

use hypervisor_provision::ProvisionConfig;

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    /// This node (the downward API's `spec.nodeName`).
    pub node: String,
    /// The DRA driver name (`--driver`, default [`crate::DRIVER`]): the
    /// ResourceSlice's driver, the plugin's name at registration, the
    /// prefix of its device taints; claims' devices of other drivers are
    /// not ours.
    pub driver: String,
    /// A kubeconfig (`--kubeconfig`); `None`: the in-cluster service
    /// account, else `KUBECONFIG` or `~/.kube/config` ([`crate::client`]).
    pub kubeconfig: Option<PathBuf>,
    /// Where provisioning puts the node's files, and what pods are told.
    pub provision: ProvisionConfig,
    /// Where the DRA plugin serves and registers with the kubelet.
    pub sockets: PluginSockets,
    /// The host's `/proc` (`hostPID`), for the workers' cgroups.
    pub proc_root: PathBuf,
    /// Refuse workers whose cgroup is not their pod's (off only for tools
    /// that run workers outside any pod, such as `k8s-e2e`).
    pub check_identity: bool,
    /// How often pods that are gone are looked for without an event, and
    /// the slice published again.
    pub resync: Duration,
    /// `--device-plugin`: also a kubelet device plugin ([`crate::deviceplugin`]).
    pub device_plugin: Option<DevicePluginConfig>,
}

/// The default device-plugin resource (HAMi's and NVIDIA's).
pub const DEFAULT_RESOURCE: &str = "nvidia.com/gpu";

/// How the plugin runs.
#[derive(Debug, Clone)]
pub struct DevicePluginConfig {
    /// The extended resources counted in shares (`nvidia.com/gpu`; add
    /// `nvidia.com/vgpu-number` for vgpu-manager's pods).
    pub resources: Vec<String>,
    /// Devices advertised per GPU: how many containers may share one.
    pub shares_per_gpu: u32,
    /// The kubelet's `device-plugins` folder (`kubelet.sock` and ours).
    pub dir: PathBuf,
    /// The kubelet's pod-resources socket; not there: pending pods are matched.
    pub pod_resources: PathBuf,
}

impl DevicePluginConfig {
    /// The kubelet's usual places under `kubelet_dir` (`/var/lib/kubelet`).
    pub fn under(kubelet_dir: &Path, shares_per_gpu: u32) -> Self {
        Self {
            resources: vec![DEFAULT_RESOURCE.to_owned()],
            shares_per_gpu,
            dir: kubelet_dir.join("device-plugins"),
            pod_resources: kubelet_dir.join("pod-resources/kubelet.sock"),
        }
    }

    /// Our socket's name for `resource` in [`Self::dir`].
    pub fn endpoint(resource: &str) -> String {
        let name: String = resource
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        format!("gpushare-{name}.sock")
    }
}

/// One GPU as the plugin advertises it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuHealth {
    /// The GPU's UUID: its shares are `<uuid>::<k>`.
    pub uuid: String,
    /// False once NVML reports it unhealthy or it is no longer seen: its
    /// shares are then advertised `Unhealthy`.
    pub healthy: bool,
}

/// Where the plugin's two sockets are.
#[derive(Debug, Clone)]
pub struct PluginSockets {
    /// `DRAPlugin`: `/var/lib/kubelet/plugins/<driver>/dra.sock`.
    pub plugin: PathBuf,
    /// Registration: `/var/lib/kubelet/plugins_registry/<driver>-reg.sock`.
    pub registration: PathBuf,
}

impl PluginSockets {
    /// The kubelet's usual places under `kubelet_dir` (`/var/lib/kubelet`).
    pub fn under(kubelet_dir: &Path, driver: &str) -> Self {
        Self {
            plugin: kubelet_dir.join("plugins").join(driver).join("dra.sock"),
            registration: kubelet_dir
                .join("plugins_registry")
                .join(format!("{driver}-reg.sock")),
        }
    }
}
