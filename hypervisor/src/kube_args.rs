//! The binary's `serve --kubernetes` flags, and the node agent's options
//! made from them.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;

/// `serve --kubernetes`: the node agent of the DRA driver.
#[derive(clap::Args)]
pub(crate) struct KubeArgs {
    /// Learn pods from Kubernetes: a DRA kubelet plugin and the node's claims.
    #[arg(long)]
    pub(crate) kubernetes: bool,
    /// This node's name; default: $NODE_NAME (the downward API's spec.nodeName).
    #[arg(long, requires = "kubernetes")]
    node_name: Option<String>,
    /// The DRA driver name.
    #[arg(long, default_value = hypervisor_kubernetes::DRIVER)]
    driver: String,
    /// A kubeconfig; default: the in-cluster service account.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// CUDA_LIMITER_HYPERVISOR for the pods; default: $HYPERVISOR_URL, else
    /// the --socket (its folder mounted into the pods), else
    /// http://<listen address>.
    #[arg(long)]
    hypervisor_url: Option<String>,
    /// Checkpoint, tokens and the preload file.
    #[arg(long, default_value = "/var/lib/gpushare")]
    state_dir: PathBuf,
    /// Where CDI specs go.
    #[arg(long, default_value = "/var/run/cdi")]
    cdi_dir: PathBuf,
    /// The host directory mounted on this container's /dev/shm.
    #[arg(long, default_value = "/var/lib/gpushare/shm")]
    host_region_dir: PathBuf,
    /// The limiter library on the host.
    #[arg(long, default_value = "/var/lib/gpushare/lib/libcuda_limiter.so")]
    host_limiter: PathBuf,
    /// The kubelet's folder (plugins/ and plugins_registry/ under it).
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
    /// The host's /proc (hostPID), for workers' cgroups.
    #[arg(long, default_value = "/proc")]
    proc_root: PathBuf,
    /// Also a kubelet device plugin: GPUs advertised as shares of
    /// nvidia.com/gpu, limits from HAMi's resource names and annotations.
    #[arg(long, requires = "kubernetes")]
    device_plugin: bool,
    /// Device plugin: shares advertised per GPU (containers that may share one).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    shares_per_gpu: u32,
    /// Device plugin: an extended resource counted in shares (repeatable;
    /// nvidia.com/vgpu-number for vgpu-manager's pods).
    #[arg(long = "device-plugin-resource", default_value = "nvidia.com/gpu")]
    device_plugin_resources: Vec<String>,
}

impl KubeArgs {
    /// The agent's options; an empty `hypervisor_url` is the bound address,
    /// filled in by the node.
    pub(crate) fn options(
        &self,
        socket: Option<&std::path::Path>,
    ) -> anyhow::Result<hypervisor_kubernetes::AgentOptions> {
        use hypervisor_kubernetes::dra::plugin::PluginSockets;
        use hypervisor_provision::ProvisionConfig;
        let node = self
            .node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok().filter(|n| !n.is_empty()))
            .context("--kubernetes needs the node name: --node-name or NODE_NAME")?;
        let url = self.hypervisor_url.clone().or_else(|| {
            std::env::var("HYPERVISOR_URL")
                .ok()
                .filter(|u| !u.is_empty())
        });
        let mut provision = match (url, socket) {
            (Some(url), _) => ProvisionConfig::daemonset(&url),
            (None, Some(socket)) => ProvisionConfig::daemonset_socket(socket)?,
            // The node fills in the address it bound.
            (None, None) => ProvisionConfig::daemonset(""),
        };
        provision.state_dir = self.state_dir.clone();
        provision.host_state_dir = self.state_dir.clone();
        provision.cdi_dir = self.cdi_dir.clone();
        provision.host_region_dir = self.host_region_dir.clone();
        provision.host_limiter = self.host_limiter.clone();
        Ok(hypervisor_kubernetes::AgentOptions {
            node,
            sockets: PluginSockets::under(&self.kubelet_dir, &self.driver),
            driver: self.driver.clone(),
            kubeconfig: self.kubeconfig.clone(),
            provision,
            proc_root: self.proc_root.clone(),
            check_identity: true,
            resync: Duration::from_secs(30),
            device_plugin: self.device_plugin.then(|| {
                let mut config = hypervisor_kubernetes::deviceplugin::DevicePluginConfig::under(
                    &self.kubelet_dir,
                    self.shares_per_gpu,
                );
                config.resources = self.device_plugin_resources.clone();
                config
            }),
        })
    }
}
