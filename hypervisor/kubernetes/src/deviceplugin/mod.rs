//! The kubelet device plugin (`serve --kubernetes --device-plugin`), for
//! clusters without DRA and pods written for HAMi or vgpu-manager.
//!
//! 1. **Shares.** Each GPU is advertised as `shares` devices
//!    `<uuid>::<k>` of the resource (`nvidia.com/gpu`), so the default
//!    scheduler puts up to that many containers on one GPU; the memory and
//!    compute names (`nvidia.com/gpumem`, …) are advertised as node capacity
//!    so pods that name them can be scheduled ([`allocator`]).
//! 2. **Registration** ([`kubelet`]): the plugin serves `DevicePlugin` on a
//!    socket in the kubelet's `device-plugins` folder and registers it with
//!    the kubelet's `Registration`; when the kubelet restarts (the folder is
//!    emptied) it serves and registers again. `ListAndWatch` streams the
//!    shares, `Unhealthy` when their GPU is no longer seen or NVML reports
//!    it unhealthy ([`hypervisor_observer::health`]), so the kubelet stops
//!    giving them out ([`service`]).
//! 3. **Allocate.** The kubelet names only share IDs. The container they are
//!    for is found ([`podresources`] or the pods pending on the node), its
//!    ask read ([`ask`]), healthy GPUs chosen ([`placement`]), and the pod's region,
//!    token and files provisioned by [`hypervisor_provision`], as for DRA; the
//!    answer is the container edits as env, mounts and device specs.
//!    A container that fits on no GPU of the node is refused, with an event
//!    on its pod.

pub mod allocator;
pub mod ask;
pub mod kubelet;
pub mod placement;
pub mod podresources;
pub mod service;

use std::future::Future;
use std::path::PathBuf;

pub use crate::options::{DEFAULT_RESOURCE, DevicePluginConfig, GpuHealth};
use hypervisor_provision::cdi::ContainerEdits;

/// Generated from `hypervisor/proto/{deviceplugin,podresources}` by
/// `build.rs`: documented only where the protos carry comments.
#[allow(missing_docs)]
pub mod pb {
    pub mod v1beta1 {
        include!(concat!(env!("OUT_DIR"), "/deviceplugin/v1beta1.rs"));
    }
    pub mod podresources {
        include!(concat!(env!("OUT_DIR"), "/deviceplugin/v1.rs"));
    }
}

/// `RegisterRequest.version`.
pub const API_VERSION: &str = "v1beta1";
/// `Device.health` of a share whose GPU is seen and healthy.
pub const HEALTHY: &str = "Healthy";
/// `Device.health` of a share whose GPU is unhealthy or no longer seen: the
/// kubelet stops giving it out.
pub const UNHEALTHY: &str = "Unhealthy";

/// The share IDs of `gpus`: `<uuid>::<k>`.
pub fn devices(gpus: &[GpuHealth], shares: u32) -> Vec<pb::v1beta1::Device> {
    gpus.iter()
        .flat_map(|gpu| {
            (0..shares).map(move |k| pb::v1beta1::Device {
                id: format!("{}::{k}", gpu.uuid),
                health: if gpu.healthy { HEALTHY } else { UNHEALTHY }.to_owned(),
                topology: None,
            })
        })
        .collect()
}

/// Why a container was refused its shares: the kubelet is told it on one
/// line ([`gpushare_utils::logging::one_line`]), and so is the pod's event.
#[derive(Debug, thiserror::Error)]
pub enum AllocateError {
    /// The agent has no device plugin settings
    /// ([`crate::AgentOptions::device_plugin`] is `None`), so it cannot
    /// find the container the shares are for.
    #[error("the device plugin is off")]
    Off,
    /// The node's pods could not be listed from the API server.
    #[error("cannot list the pods of node {node}: {source}")]
    Pods {
        /// This node's name.
        node: String,
        /// kube-rs's error.
        #[source]
        source: kube::Error,
    },
    /// No container of a pod starting on the node asks for this many shares
    /// of the resource and still lacks them: the shares match no container.
    #[error(
        "no pod starting on node {node} has a container without GPUs asking for {count} {resource}"
    )]
    NoContainer {
        /// This node's name.
        node: String,
        /// The shares the kubelet allocated.
        count: usize,
        /// The extended resource, such as `nvidia.com/gpu`.
        resource: String,
    },
    /// The container the kubelet's pod-resources list names for the shares
    /// is not in its pod's spec (its name).
    #[error("no container {0}")]
    NoSuchContainer(String),
    /// The container that holds the shares has no limit of the resource.
    #[error("container {container} asks for no {resource}")]
    NoAsk {
        /// The container's name.
        container: String,
        /// The extended resource.
        resource: String,
    },
    /// The container's limits or its pod's annotations cannot be read.
    #[error(transparent)]
    Ask(#[from] ask::AskError),
    /// Too few of the node's healthy GPUs fit the ask.
    #[error(transparent)]
    Placement(#[from] placement::Refusal),
    /// No random UID for the claim, or the prepared claim's container edits
    /// could not be built.
    #[error(transparent)]
    Provision(#[from] hypervisor_provision::ProvisionError),
    /// The claim could not be provisioned or its pod's region opened;
    /// nothing of it is left.
    #[error(transparent)]
    Prepare(#[from] crate::state::PrepareError),
    /// Fail closed: the shares went to another container than the one
    /// whose limits were provisioned.
    #[error(transparent)]
    Mismatch(Box<SharesMismatch>),
}

/// Shares that went to another container than the one whose limits were
/// provisioned for them.
#[derive(Debug, thiserror::Error)]
#[error(
    "shares {devices:?} went to {namespace}/{name} container {holder}, but were provisioned for pod {uid} container {container}"
)]
pub struct SharesMismatch {
    /// The share IDs (`<uuid>::<k>`).
    pub devices: Vec<String>,
    /// Namespace of the pod the kubelet gave them to.
    pub namespace: String,
    /// Name of that pod.
    pub name: String,
    /// The container the kubelet's pod-resources list says holds them.
    pub holder: String,
    /// UID of the pod whose limits were provisioned for them.
    pub uid: String,
    /// The container whose limits were provisioned for them.
    pub container: String,
}

/// What allocating means: the Kubernetes agent's ([`allocator`]).
pub trait Allocator: Send + Sync + 'static {
    /// The edits for the container given `devices` of `resource`.
    fn allocate(
        &self,
        resource: &str,
        devices: Vec<String>,
    ) -> impl Future<Output = Result<ContainerEdits, AllocateError>> + Send;
    /// Checks, before the container starts, that `devices` went to the
    /// container they were provisioned for.
    fn pre_start(
        &self,
        resource: &str,
        devices: Vec<String>,
    ) -> impl Future<Output = Result<(), AllocateError>> + Send;
}

/// Why the plugin stopped.
#[derive(Debug, thiserror::Error)]
pub enum DevicePluginError {
    /// A resource's socket cannot be made in the kubelet's
    /// `device-plugins` folder, or a resource's task panicked.
    #[error("socket {}: {source}", path.display())]
    Socket {
        /// The socket; the folder for a task that panicked.
        path: PathBuf,
        /// The system's reason, or the panic.
        #[source]
        source: std::io::Error,
    },
    /// The kubelet's registration socket cannot be reached (the kubelet is
    /// down, or the folder is not the kubelet's).
    #[error("cannot connect to the kubelet at {}: {source}", path.display())]
    Connect {
        /// The kubelet's socket, [`kubelet::KUBELET_SOCKET`] in the folder.
        path: PathBuf,
        /// tonic's reason.
        #[source]
        source: tonic::transport::Error,
    },
    /// The kubelet refused to register the plugin for a resource.
    #[error("the kubelet refused {resource}: {status}")]
    Register {
        /// The extended resource.
        resource: String,
        /// The kubelet's answer.
        status: tonic::Status,
    },
}
