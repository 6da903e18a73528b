//! A claim the node refuses to prepare, said where its user looks: a
//! Warning event on the ResourceClaim (reason [`REASON`]), which
//! `kubectl describe resourceclaim` lists, and the agent's log at WARN.
//! The kubelet asks again every few seconds while the pod waits: each
//! refusal is said once, and again only when its reason changes; the
//! repeats are logged at DEBUG.

use gpushare_utils::logging::one_line;
use k8s_openapi::api::core::v1::ObjectReference;

use super::{ClaimRef, ClaimRefused};
use crate::NodeAgent;
use crate::state::EventKind;

/// The reason of the event on a refused claim.
pub const REASON: &str = "PrepareFailed";
/// The component the event says it is from.
pub const COMPONENT: &str = "gpushare-node";

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
