//! The DRA kubelet plugin: a registration socket in the kubelet's plugin
//! registry ([`registration`]) and the `DRAPlugin` service, v1 and v1beta1,
//! on the plugin's own socket ([`plugin`]). What preparing means is up to a
//! [`ClaimPreparer`] (the Kubernetes agent's: [`crate`]).

pub mod claims;
pub mod parameters;
pub mod plugin;
mod prepare;
pub mod refusal;
pub mod registration;
pub mod slice;
pub mod socket;

/// Generated from `hypervisor/proto` by `build.rs`: documented only where
/// the protos carry comments.
#[allow(missing_docs)]
pub mod pb {
    pub mod v1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1");
    }
    pub mod v1beta1 {
        tonic::include_proto!("k8s.io.kubelet.pkg.apis.dra.v1beta1");
    }
    /// v1beta1 under the short package name of kubelets 1.32 and 1.33.
    pub mod v1beta1_legacy {
        tonic::include_proto!("v1beta1");
    }
    pub mod registration {
        tonic::include_proto!("pluginregistration");
    }
}

use std::future::Future;

use crate::KubeError;
use crate::state::PrepareError;
use hypervisor_provision::ProvisionError;

/// The services a kubelet may call, as listed at registration.
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
/// `PluginInfo.type` of a DRA plugin.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    /// The claim's namespace.
    pub namespace: String,
    /// The claim's UID: keys the prepared claims, and must match the object
    /// read by name ([`claims::check_uid`]), so a claim deleted and made
    /// again under the same name is not mistaken for the old one.
    pub uid: String,
    /// The ResourceClaim's name, by which it is read from the API.
    pub name: String,
}

/// One device a prepared claim got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    /// The claim's requests this device serves, from its allocation.
    pub request_names: Vec<String>,
    /// The ResourceSlice pool: the node's name.
    pub pool_name: String,
    /// The device's name in the slice, `gpu-<index>`.
    pub device_name: String,
    /// What the container runtime injects: the claim's one CDI device,
    /// `<vendor>/<class>=<claim uid>`, the same for each of its devices.
    pub cdi_device_ids: Vec<String>,
}

/// Why a claim could not be prepared or unprepared: the kubelet is told
/// it on one line ([`gpushare_utils::logging::one_line`]).
#[derive(Debug, thiserror::Error)]
pub enum ClaimRefused {
    /// Reading the claim from the API server failed (it is read there when
    /// the reflector's copy is missing, of another UID, or not yet
    /// allocated and reserved).
    #[error("cannot read claim {namespace}/{name}: {source}")]
    Read {
        /// The claim's namespace.
        namespace: String,
        /// The claim's name.
        name: String,
        /// kube-rs's error (not found, forbidden, unreachable).
        #[source]
        source: kube::Error,
    },
    /// The claim, as read, cannot become limits on this node.
    #[error(transparent)]
    Claim(#[from] claims::ClaimError),
    /// The claim could not be provisioned or its pod's region opened;
    /// nothing of it is left.
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    /// Unpreparing failed: the checkpoint could not be saved or the claim's
    /// files removed.
    #[error(transparent)]
    Unprepare(#[from] ProvisionError),
    /// The claim was unprepared, but the hypervisor's pods could not be
    /// brought in line with the claims left.
    #[error(transparent)]
    Pods(#[from] KubeError),
}

/// Prepares and unprepares claims. Saying why a claim was refused is the
/// preparer's (the agent's: [`refusal`]); the plugin tells the kubelet and
/// logs it at DEBUG.
pub trait ClaimPreparer: Send + Sync + 'static {
    /// Prepares `claim`: the devices it got and their CDI IDs.
    fn prepare(
        &self,
        claim: ClaimRef,
    ) -> impl Future<Output = Result<Vec<PreparedDevice>, ClaimRefused>> + Send;
    /// Unprepares `claim`; one that is not prepared is no error.
    fn unprepare(&self, claim: ClaimRef) -> impl Future<Output = Result<(), ClaimRefused>> + Send;
}
