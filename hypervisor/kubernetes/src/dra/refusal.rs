//! A claim the node refuses to prepare, said where its user looks: a
//! Warning event on the ResourceClaim (reason [`REASON`]), which
//! `kubectl describe resourceclaim` lists, and the agent's log at WARN.
//! The kubelet asks again every few seconds while the pod waits: each
//! refusal is said once, and again only when its reason changes; the
//! repeats are logged at DEBUG.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};

use gpushare_utils::logging::one_line;
use k8s_openapi::api::core::v1::ObjectReference;

use super::{ClaimRef, ClaimRefused};
use crate::NodeAgent;
use crate::state::EventKind;

/// The reason of the event on a refused claim.
pub const REASON: &str = "PrepareFailed";
/// The component the event says it is from.
pub const COMPONENT: &str = "gpushare-node";

/// The last refusal of each claim refused and not prepared since, by UID.
#[derive(Debug, Default)]
pub(crate) struct Refusals {
    last: Mutex<HashMap<String, String>>,
}

impl Refusals {
    /// Notes that claim `uid` was refused for `reason`; whether that is
    /// news (its first refusal, or another reason than the last). Claims
    /// for which `exists` says no are forgotten.
    fn news(&self, uid: &str, reason: &str, exists: impl Fn(&str) -> bool) -> bool {
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

impl NodeAgent {
    /// Says that `claim` was refused: the first time and when the reason
    /// changes, at WARN and as an event on the claim; else at DEBUG.
    pub(super) async fn report_refusal(&self, claim: &ClaimRef, refused: &ClaimRefused) {
        let reason = one_line(refused);
        let claims = &self.inner.claims;
        let exists = |uid: &str| {
            uid == claim.uid
                || claims
                    .find(|c| c.metadata.uid.as_deref() == Some(uid))
                    .is_some()
        };
        if !self.inner.refusals.news(&claim.uid, &reason, exists) {
            tracing::debug!(claim = %claim.name, namespace = %claim.namespace, uid = %claim.uid, error = reason, "prepare refused again");
            return;
        }
        tracing::warn!(claim = %claim.name, namespace = %claim.namespace, uid = %claim.uid, error = reason, "prepare refused");
        let about = ObjectReference {
            api_version: Some("resource.k8s.io/v1".to_owned()),
            kind: Some("ResourceClaim".to_owned()),
            namespace: Some(claim.namespace.clone()),
            name: Some(claim.name.clone()),
            uid: Some(claim.uid.clone()),
            ..ObjectReference::default()
        };
        self.record_event(about, COMPONENT, (EventKind::Warning, REASON), &reason)
            .await;
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
