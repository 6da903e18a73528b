//! The DRA kubelet plugin: a registration socket in the kubelet's plugin
//! registry ([`registration`]) and the `DRAPlugin` service, v1 and v1beta1,
//! on the plugin's own socket ([`plugin`]). What preparing means is up to a
//! [`ClaimPreparer`] (the Kubernetes agent's: [`crate`]).

pub mod claims;
pub mod plugin;
mod prepare;
pub mod registration;
pub mod slice;
pub mod socket;

/// Generated from `hypervisor/proto` by `build.rs`.
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
use crate::provision::ProvisionError;
use crate::state::PrepareError;

/// The services a kubelet may call, as listed at registration.
pub const SUPPORTED_VERSIONS: [&str; 2] = ["v1.DRAPlugin", "v1beta1.DRAPlugin"];
/// `PluginInfo.type` of a DRA plugin.
pub const PLUGIN_TYPE: &str = "DRAPlugin";

/// A claim as the kubelet names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRef {
    pub namespace: String,
    pub uid: String,
    pub name: String,
}

/// One device a prepared claim got.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PreparedDevice {
    pub request_names: Vec<String>,
    pub pool_name: String,
    pub device_name: String,
    pub cdi_device_ids: Vec<String>,
}

/// Why a claim could not be prepared or unprepared: the kubelet is told
/// it on one line ([`gpushare_utils::logging::one_line`]).
#[derive(Debug, thiserror::Error)]
pub enum ClaimRefused {
    #[error("cannot read claim {namespace}/{name}: {source}")]
    Read {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error(transparent)]
    Claim(#[from] claims::ClaimError),
    #[error(transparent)]
    Prepare(#[from] PrepareError),
    #[error(transparent)]
    Unprepare(#[from] ProvisionError),
    #[error(transparent)]
    Pods(#[from] KubeError),
}

/// Prepares and unprepares claims.
pub trait ClaimPreparer: Send + Sync + 'static {
    /// Prepares `claim`: the devices it got and their CDI IDs.
    fn prepare(
        &self,
        claim: ClaimRef,
    ) -> impl Future<Output = Result<Vec<PreparedDevice>, ClaimRefused>> + Send;
    /// Unprepares `claim`; one that is not prepared is no error.
    fn unprepare(&self, claim: ClaimRef) -> impl Future<Output = Result<(), ClaimRefused>> + Send;
}
