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
//!    token and files provisioned by [`crate::provision`], as for DRA; the
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
use crate::provision::cdi::ContainerEdits;

/// Generated from `hypervisor/proto/{deviceplugin,podresources}` by `build.rs`.
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
pub const HEALTHY: &str = "Healthy";
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
    #[error("the device plugin is off")]
    Off,
    #[error("cannot list the pods of node {node}: {source}")]
    Pods {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error(
        "no pod starting on node {node} has a container without GPUs asking for {count} {resource}"
    )]
    NoContainer {
        node: String,
        count: usize,
        resource: String,
    },
    #[error("no container {0}")]
    NoSuchContainer(String),
    #[error("container {container} asks for no {resource}")]
    NoAsk { container: String, resource: String },
    #[error(transparent)]
    Ask(#[from] ask::AskError),
    #[error(transparent)]
    Placement(#[from] placement::Refusal),
    #[error(transparent)]
    Provision(#[from] crate::provision::ProvisionError),
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
    pub devices: Vec<String>,
    pub namespace: String,
    pub name: String,
    pub holder: String,
    pub uid: String,
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
    #[error("socket {}: {source}", path.display())]
    Socket {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot connect to the kubelet at {}: {source}", path.display())]
    Connect {
        path: PathBuf,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the kubelet refused {resource}: {status}")]
    Register {
        resource: String,
        status: tonic::Status,
    },
    #[error("gRPC server: {0}")]
    Serve(#[from] tonic::transport::Error),
}
