//! `hypervisor serve --kubernetes`: the node agent of the DRA driver.
//!
//! 1. **Slice** ([`dra::slice`]): the node's GPUs published as one ResourceSlice,
//!    shareable devices with `memory` and `compute` capacities.
//! 2. **Reflectors** (the agent): this node's Pods (field selector
//!    `spec.nodeName`) and the ResourceClaims, kept in memory by kube-rs.
//! 3. **Prepare** (the kubelet, over [`crate::dra`]): the claim read from the
//!    reflector (or the API server when it is newer than the reflector),
//!    translated ([`dra::claims`]), provisioned ([`hypervisor_provision`]), and the
//!    hypervisor's pods made those of the prepared claims
//!    ([`KubernetesSource`]), which opens the pod's region with its limits
//!    before the containers start.
//! 4. **Pods gone**: a pod with prepared claims that the API server no
//!    longer has (or that finished) loses its claims, token and region,
//!    unless another running pod uses them (`consumers`).
//! 5. **Identity**: workers are checked against their cgroup
//!    ([`hypervisor_core::identity`]); a pod that uses a claim prepared under another
//!    quota identity counts as that identity's (`consumers`).
//! 6. **Device plugin** (`--device-plugin`, [`deviceplugin::allocator`]): containers that ask
//!    for `nvidia.com/gpu` shares get a claim of their own, made from their
//!    pod's resource names, provisioned as in 3.
//!
//! The modules form one way: [`options`] (plain settings) ← `state` (what
//! the agent holds, and provisioning a claim) ← one folder per mode,
//! [`dra`] and [`deviceplugin`], and `consumers` ← `agent` (start, run,
//! clean-up of pods that are gone). `hypervisor-provision` is what both modes give a
//! container.

mod agent;
mod consumers;
pub mod deviceplugin;
pub mod dra;
pub mod options;
pub mod quantity;
mod state;

use std::path::Path;
use std::sync::{Arc, Mutex};

pub use options::AgentOptions;
pub use state::NodeAgent;

use hypervisor_core::spec::PodSpec;
use hypervisor_daemon::source::PodSource;
use hypervisor_provision::Provisioner;

/// The default driver name.
pub const DRIVER: &str = "gpu.gpushare.dev";

/// Log targets of kube whose events the daemon's log leaves out: its HTTP
/// layer says ERROR for every request that fails, also those the agent
/// tries again (while an API server starts or restarts) and reports itself,
/// with what it was doing.
pub const QUIET_LOG_TARGETS: &[&str] = &["kube_client::client::builder"];

/// Why the agent failed.
#[derive(Debug, thiserror::Error)]
pub enum KubeError {
    /// The kubeconfig given with `--kubeconfig` cannot be read, parsed or
    /// turned into a client configuration.
    #[error("kubeconfig {path}: {message}")]
    Kubeconfig {
        /// The file, as given.
        path: String,
        /// kube-rs's reason.
        message: String,
    },
    /// No kubeconfig was given and none was found: not in a pod with a
    /// service account, no `KUBECONFIG`, no `~/.kube/config`.
    #[error("no Kubernetes configuration (in-cluster or KUBECONFIG): {0}")]
    Infer(String),
    /// The configuration was read but is not usable as a client (its TLS
    /// settings or credentials, for instance).
    #[error("cannot build the API client: {0}")]
    Client(String),
    /// A request to the API server failed (unreachable, forbidden by the
    /// agent's RBAC, or refused).
    #[error("{what}: {source}")]
    Api {
        /// The request, such as `get pod` or `create resourceslice`.
        what: &'static str,
        /// kube-rs's error, with the API server's status when it answered.
        #[source]
        source: kube::Error,
    },
    /// The checkpoint could not be opened, a gone pod's claims not
    /// removed, or the prepared claims not turned into the hypervisor's
    /// pods.
    #[error(transparent)]
    Provision(#[from] hypervisor_provision::ProvisionError),
    /// The DRA plugin's or its registration socket cannot be created or
    /// served (the kubelet's folders missing or not writable).
    #[error("kubelet plugin sockets: {0}")]
    Plugin(#[source] std::io::Error),
}

impl KubeError {
    pub(crate) fn api(what: &'static str) -> impl FnOnce(kube::Error) -> Self {
        move |source| Self::Api { what, source }
    }
}

/// A client from the kubeconfig at `path`, or the in-cluster service
/// account (then `KUBECONFIG`, `~/.kube/config`) when `None`.
pub async fn client(path: Option<&Path>) -> Result<kube::Client, KubeError> {
    // Already installed (by an earlier call): fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let config = match path {
        Some(path) => {
            let kubeconfig =
                kube::config::Kubeconfig::read_from(path).map_err(|e| KubeError::Kubeconfig {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &Default::default())
                .await
                .map_err(|e| KubeError::Kubeconfig {
                    path: path.display().to_string(),
                    message: e.to_string(),
                })?
        }
        None => kube::Config::infer()
            .await
            .map_err(|e| KubeError::Infer(e.to_string()))?,
    };
    kube::Client::try_from(config).map_err(|e| KubeError::Client(e.to_string()))
}

/// The hypervisor's pods from the prepared claims.
#[derive(Clone)]
pub struct KubernetesSource {
    /// The prepared claims, shared with the agent, which prepares and
    /// forgets them; [`PodSource::pods`] reads their pods from it.
    pub provisioner: Arc<Mutex<Provisioner>>,
}

impl PodSource for KubernetesSource {
    type Error = hypervisor_provision::ProvisionError;

    fn pods(&self) -> Result<Vec<PodSpec>, Self::Error> {
        let provisioner = self
            .provisioner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        provisioner.pod_specs()
    }
}
