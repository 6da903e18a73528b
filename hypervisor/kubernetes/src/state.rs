//! The node agent's state, shared by both modes and the clean-up: the
//! client, the reflectors' stores, the prepared claims, and what each mode
//! keeps; and what both modes do with it (provision a claim, make the
//! hypervisor's pods those of the prepared claims).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::runtime::reflector::Store;
use tokio::sync::{Notify, watch};

use crate::options::{AgentOptions, GpuHealth};
use crate::{KubeError, KubernetesSource};
use hypervisor_daemon::Hypervisor;
use hypervisor_daemon::source;
use hypervisor_observer::Unhealthy;
use hypervisor_provision::{ClaimRequest, ProvisionError, Provisioner};

/// Why a claim (of either mode) could not be provisioned.
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    #[error(transparent)]
    Provision(#[from] ProvisionError),
    #[error("claim {claim}: the pod's region could not be opened: {reason}")]
    NoRegion { claim: String, reason: String },
}

/// What the agent holds.
pub(crate) struct Inner {
    pub(crate) hv: Hypervisor,
    pub(crate) client: kube::Client,
    pub(crate) options: AgentOptions,
    pub(crate) source: KubernetesSource,
    pub(crate) pods: Store<Pod>,
    pub(crate) claims: Store<ResourceClaim>,
    /// Serialises prepare, unprepare, allocate and clean-up.
    pub(crate) busy: tokio::sync::Mutex<()>,
    pub(crate) changed: Notify,
    /// The GPUs as the device plugin advertises them.
    pub(crate) gpu_health: watch::Sender<Vec<GpuHealth>>,
    /// Device plugin allocations not yet started: the sorted share IDs, and
    /// the (pod UID, container) they were provisioned for.
    pub(crate) allocated: Mutex<BTreeMap<Vec<String>, (String, String)>>,
    /// The unhealthy GPUs whose taints the API server dropped (its
    /// `DRADeviceTaints` gate is off): published without taints until
    /// health changes again.
    pub(crate) taints_dropped: Mutex<Option<BTreeMap<String, Unhealthy>>>,
}

/// The running agent; cheap to clone.
#[derive(Clone)]
pub struct NodeAgent {
    pub(crate) inner: Arc<Inner>,
}

impl NodeAgent {
    /// The options it runs with (the hypervisor's URL filled in).
    pub fn options(&self) -> &AgentOptions {
        &self.inner.options
    }

    /// The provisioner (prepared claims), to look at.
    pub fn provisioner(&self) -> MutexGuard<'_, Provisioner> {
        self.inner
            .source
            .provisioner
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Prepares `request` and opens its pod's region with its limits (the
    /// caller holds `busy`); nothing is left when the region cannot be
    /// opened. Returns the CDI device IDs.
    pub(crate) fn provision(&self, request: &ClaimRequest) -> Result<Vec<String>, PrepareError> {
        let cdi = self.provisioner().prepare(request.clone())?;
        let failed = match source::sync(&self.inner.hv, &self.inner.source) {
            Ok(report) => report
                .failed
                .into_iter()
                .find(|(pod, _)| *pod == request.pod.uid)
                .map(|(_, reason)| reason),
            Err(error) => Some(error.to_string()),
        };
        if let Some(reason) = failed {
            // No region, no limits: the container must not start.
            let _ = self.provisioner().unprepare(&request.claim_uid);
            let _ = self.sync();
            return Err(PrepareError::NoRegion {
                claim: request.claim_uid.clone(),
                reason,
            });
        }
        Ok(cdi)
    }

    pub(crate) fn sync(&self) -> Result<(), KubeError> {
        let report = source::sync(&self.inner.hv, &self.inner.source)?;
        if !report.failed.is_empty() {
            tracing::error!(failed = ?report.failed, "pods without a region");
        }
        Ok(())
    }
}
