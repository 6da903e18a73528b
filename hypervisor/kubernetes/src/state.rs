//! The node agent's state, shared by both modes and the clean-up: the
//! client, the reflectors' stores, the prepared claims, and what each mode
//! keeps; and what both modes do with it (provision a claim, make the
//! hypervisor's pods those of the prepared claims).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference, Pod};
use k8s_openapi::api::resource::v1::ResourceClaim;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use kube::api::{Api, PostParams};
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

/// An event's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventKind {
    Normal,
    Warning,
}

impl EventKind {
    /// As the API writes it.
    fn as_str(self) -> &'static str {
        match self {
            Self::Normal => "Normal",
            Self::Warning => "Warning",
        }
    }
}

/// The last refusal of each claim refused and not prepared since, by UID:
/// the DRA plugin says a refusal once per reason, however often the
/// kubelet asks again.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    last: Mutex<HashMap<String, String>>,
}

impl Refusals {
    /// Notes that claim `uid` was refused for `reason`; whether that is
    /// news (its first refusal, or another reason than the last). Claims
    /// for which `exists` says no are forgotten.
    pub(crate) fn news(&self, uid: &str, reason: &str, exists: impl Fn(&str) -> bool) -> bool {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.get(uid).is_some_and(|before| before == reason) {
            return false;
        }
        last.retain(|claim, _| exists(claim));
        last.insert(uid.to_owned(), reason.to_owned());
        true
    }

    /// Forgets claim `uid`'s refusal: it was prepared, or unprepared.
    pub(crate) fn clear(&self, uid: &str) {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(uid);
    }
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
    /// The claims refused at prepare, each said once per reason.
    pub(crate) refusals: Refusals,
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

    /// Records an event of `kind` with `reason` and `message` about
    /// `about`, from `component` on this node; a failure to is only logged.
    pub(crate) async fn record_event(
        &self,
        about: ObjectReference,
        component: &str,
        (kind, reason): (EventKind, &str),
        message: &str,
    ) {
        let namespace = about.namespace.clone().unwrap_or_default();
        let node = &self.inner.options.node;
        let now = Time(k8s_openapi::jiff::Timestamp::now());
        let event = Event {
            metadata: ObjectMeta {
                generate_name: Some(format!("{}.", about.name.as_deref().unwrap_or_default())),
                namespace: Some(namespace.clone()),
                ..ObjectMeta::default()
            },
            involved_object: about,
            reason: Some(reason.to_owned()),
            message: Some(message.to_owned()),
            type_: Some(kind.as_str().to_owned()),
            source: Some(EventSource {
                component: Some(component.to_owned()),
                host: Some(node.clone()),
            }),
            reporting_component: Some(component.to_owned()),
            reporting_instance: Some(node.clone()),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            count: Some(1),
            ..Event::default()
        };
        if let Err(error) = Api::<Event>::namespaced(self.inner.client.clone(), &namespace)
            .create(&PostParams::default(), &event)
            .await
        {
            tracing::warn!(%error, reason, "event not recorded");
        }
    }

    pub(crate) fn sync(&self) -> Result<(), KubeError> {
        let report = source::sync(&self.inner.hv, &self.inner.source)?;
        if !report.failed.is_empty() {
            tracing::error!(failed = ?report.failed, "pods without a region");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_news_once_per_reason() {
        let refusals = Refusals::default();
        let all = |_: &str| true;
        assert!(refusals.news("a", "weight 0", all));
        assert!(!refusals.news("a", "weight 0", all));
        assert!(refusals.news("b", "weight 0", all), "another claim's");
        assert!(refusals.news("a", "weight 0; colour", all), "a new reason");
        assert!(!refusals.news("a", "weight 0; colour", all));
        // Prepared since: a later refusal is news again.
        refusals.clear("a");
        assert!(refusals.news("a", "weight 0; colour", all));
        // Claims that are gone are forgotten.
        assert!(refusals.news("c", "x", |uid| uid != "b"));
        assert!(refusals.news("b", "weight 0", all));
    }
}
