//! Who uses the claims prepared under a quota identity (a pod's UID, or a
//! shared claim's own): the pods in their `reservedFor`, from the claims'
//! reflector or, where it may lag, from the API; and the worker check that
//! accepts a process of any such pod as the identity's.

use std::collections::BTreeMap;
use std::sync::{Arc, PoisonError, Weak};

use k8s_openapi::api::resource::v1::ResourceClaim;
use kube::api::Api;
use kube::runtime::reflector::ObjectRef;

use crate::KubeError;
use crate::dra::claims;
use crate::state::Inner;
use gpushare_utils::pod::PodId;
use hypervisor_core::identity::{CgroupIdentity, IdentityError, WorkerIdentity};

/// The cgroup check of a registering worker, where the pods that use the
/// claims prepared under its quota identity are that identity's too.
pub(super) struct ClaimIdentity {
    pub(super) cgroup: CgroupIdentity,
    pub(super) agent: Weak<Inner>,
}

impl WorkerIdentity for ClaimIdentity {
    /// Runs on a blocking thread of the runtime (the registration handler's
    /// `spawn_blocking`).
    fn verify(&self, pod: &PodId, pid: u32) -> Result<u32, IdentityError> {
        let Some(inner) = self.agent.upgrade() else {
            return self.cgroup.find(pod, pid, &|uid| uid == pod.as_str());
        };
        let check = |shared: &BTreeMap<String, String>| {
            self.cgroup.find(pod, pid, &|uid| {
                uid == pod.as_str() || shared.contains_key(uid)
            })
        };
        let prepared = prepared_claims(&inner, pod.as_str());
        let refused = match check(&consumers(&inner, &prepared)) {
            Err(refused @ IdentityError::NotInPod { .. }) => refused,
            other => return other,
        };
        // The claims' reflector may not have a reservation made just now:
        // the API's claims decide, where the identity has claims at all.
        if prepared.is_empty() {
            return Err(refused);
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return Err(refused);
        };
        match runtime.block_on(consumers_from_api(&inner, &prepared)) {
            Ok(live) => check(&live),
            Err(error) => {
                tracing::warn!(%error, pod = %pod, "claims not read from the API for a worker's check");
                Err(refused)
            }
        }
    }
}

/// A claim prepared on this node, by the names the API knows it by.
pub(super) struct PreparedClaim {
    namespace: String,
    name: String,
    uid: String,
}

/// The pods (UID → name) in the `reservedFor` of claims `prepared`, as the
/// claims' reflector has them.
pub(super) fn consumers(inner: &Inner, prepared: &[PreparedClaim]) -> BTreeMap<String, String> {
    prepared
        .iter()
        .filter_map(|c| cached_claim(inner, &c.namespace, &c.name, &c.uid))
        .flat_map(|claim| claims::consumer_pods(&claim))
        .collect()
}

/// [`consumers`] as the API has the claims now (a claim deleted or replaced
/// by another of its name has none).
pub(super) async fn consumers_from_api(
    inner: &Inner,
    prepared: &[PreparedClaim],
) -> Result<BTreeMap<String, String>, KubeError> {
    let mut pods = BTreeMap::new();
    for PreparedClaim {
        namespace,
        name,
        uid,
    } in prepared
    {
        let api: Api<ResourceClaim> = Api::namespaced(inner.client.clone(), namespace);
        let live = api
            .get_opt(name)
            .await
            .map_err(KubeError::api("get claim"))?;
        if let Some(claim) = live.filter(|c| c.metadata.uid.as_deref() == Some(uid.as_str())) {
            pods.extend(claims::consumer_pods(&claim));
        }
    }
    Ok(pods)
}

/// The claims prepared under quota identity `identity`.
pub(super) fn prepared_claims(inner: &Inner, identity: &str) -> Vec<PreparedClaim> {
    inner
        .source
        .provisioner
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .claims()
        .values()
        .filter(|c| c.request.pod.uid == identity)
        .map(|c| PreparedClaim {
            namespace: c.request.namespace.clone(),
            name: c.request.name.clone(),
            uid: c.request.claim_uid.clone(),
        })
        .collect()
}

/// Claim `namespace/name` as the claims' reflector has it, if it is the
/// one with UID `uid` and its reservation is there.
fn cached_claim(
    inner: &Inner,
    namespace: &str,
    name: &str,
    uid: &str,
) -> Option<Arc<ResourceClaim>> {
    let key = ObjectRef::new(name).within(namespace);
    inner.claims.get(&key).filter(|claim| {
        claim.metadata.uid.as_deref() == Some(uid)
            && claim
                .status
                .as_ref()
                .is_some_and(|s| s.reserved_for.is_some())
    })
}
