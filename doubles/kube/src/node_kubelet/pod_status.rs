//! The pod's status as the kubelet double writes it: its containers ended,
//! its deletion confirmed, and the patch both go through.

use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, Patch, PatchParams, Preconditions};
use serde_json::json;

use super::Sync;

impl Sync {
    /// The containers exit with `code`; the pod is Succeeded or Failed.
    pub(super) async fn end(&self, pod: &Pod, code: i32) -> Result<(), kube::Error> {
        let now = now_seconds();
        let containers: Vec<_> = containers(pod)
            .map(|(name, image)| json!({"name": name, "image": image, "imageID": "", "ready": false,
                "restartCount": 0, "started": false,
                "state": {"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" },
                    "startedAt": now, "finishedAt": now}}}))
            .collect();
        let status = json!({"status": {
            "phase": if code == 0 { "Succeeded" } else { "Failed" },
            "conditions": [{"type": "Ready", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now},
                {"type": "ContainersReady", "status": "False", "reason": "PodCompleted", "lastTransitionTime": now}],
            "containerStatuses": containers,
        }});
        self.patch_status(pod, &status).await
    }

    /// Confirms a graceful deletion: deletes the pod with no grace left.
    pub(super) async fn confirm_deletion(&self, pod: &Pod) -> Result<(), kube::Error> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: pod.metadata.uid.clone(),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        match Api::<Pod>::namespaced(self.client.clone(), &ns)
            .delete(&name, &params)
            .await
        {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => Ok(()),
            Err(error) => Err(error),
        }
    }

    pub(super) async fn patch_status(
        &self,
        pod: &Pod,
        status: &serde_json::Value,
    ) -> Result<(), kube::Error> {
        let ns = pod.metadata.namespace.clone().unwrap_or_default();
        let name = pod.metadata.name.clone().unwrap_or_default();
        Api::<Pod>::namespaced(self.client.clone(), &ns)
            .patch_status(&name, &PatchParams::default(), &Patch::Strategic(status))
            .await
            .map(drop)
    }
}

/// Each container's name and image.
pub(super) fn containers(pod: &Pod) -> impl Iterator<Item = (String, String)> + '_ {
    pod.spec
        .iter()
        .flat_map(|s| s.containers.iter())
        .map(|c| (c.name.clone(), c.image.clone().unwrap_or_default()))
}

/// Now, in whole seconds, as the API writes times.
pub(super) fn now_seconds() -> String {
    let now = Timestamp::now();
    Timestamp::from_second(now.as_second())
        .unwrap_or(now)
        .to_string()
}
