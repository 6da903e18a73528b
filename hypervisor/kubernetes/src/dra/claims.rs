//! A ResourceClaim allocated by the scheduler, as provisioning needs it: the
//! pod it is reserved for, and per device of this driver and node the GPU,
//! the consumed `memory` and `compute`, and the opaque parameters.
//!
//! **Whose quota a claim is.** A claim is one allocation: the scheduler took
//! its `memory` and `compute` from the device once, whatever the number of
//! pods in its `reservedFor`. And the kubelet prepares a claim once per node
//! (`NodePrepareResources` names the claim, not the pod) and gives every
//! later pod that uses it the same CDI devices, whose edits (the region, the
//! token, `CUDA_LIMITER_POD`) cannot differ by pod. So the pods of a shared
//! claim cannot each get a quota of their own; they share the claim's one
//! quota identity ([`quota_identity`]):
//! - one consumer when prepared (a claim from a pod's template, or a claim of
//!   its own used by one pod so far): the pod, as for any claim;
//! - several consumers when prepared: the claim itself (its UID and name);
//! - either way, every pod in `reservedFor` is accepted as that identity's
//!   worker (the cgroup check, [`consumer_pods`]), and the identity is kept
//!   until the last of them has ended, not the first one.
//!
//! Opaque parameters (`spec.devices.config[].opaque.parameters`, copied by
//! the scheduler into `status.allocation.devices.config`, class configs
//! first, claim configs after and winning):
//!
//! ```yaml
//! apiVersion: gpu.gpushare.dev/v1alpha1
//! kind: GpuShareParameters
//! weight: 2          # default 1
//! policy: elastic    # fixed (default) | elastic | none
//! ceiling: 80        # elastic ceiling in percent (default 100)
//! priority: 10       # default 0
//! class: latency     # batch (default) | latency: served first on the GPU;
//!                    # on a co-run GPU also its MPS client's share of
//!                    # the SMs and priority (see `provision::mps`)
//! oversubscribe: true  # past the quota, serve from pinned host memory (default false)
//! spillLimit: 16Gi   # pod-wide cap of that host memory per GPU (implies
//!                    # oversubscribe; default with it: a quarter of the
//!                    # node's memory; 0 = none)
//! ```

use gpushare_utils::pod::PodClass;
use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};
use serde::Deserialize;

use super::slice;
use crate::quantity;
use hypervisor_core::spec::{self, Policy};
use hypervisor_observer::GpuInfo;
use hypervisor_provision::{ClaimRequest, DeviceGrant, PodRef, SharingParams};

/// Why a claim cannot be prepared here.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ClaimError {
    /// The claim (its name) has no device allocation in its status.
    #[error("claim {0} is not allocated")]
    NotAllocated(String),
    /// The claim (its name) has no pod in `status.reservedFor`, so it has
    /// no quota identity.
    #[error("claim {0} is reserved for no pod")]
    NoPod(String),
    /// The claim was given a device of this driver and node that matches
    /// none of the GPUs the node sees now.
    #[error("claim {claim}: device {device} of pool {pool} is not a GPU of this node")]
    UnknownDevice {
        /// The claim's name.
        claim: String,
        /// The device's pool (this node's name).
        pool: String,
        /// The device's name, `gpu-<index>` for one of ours.
        device: String,
    },
    /// A consumed capacity is not a Kubernetes quantity.
    #[error("claim {claim}: consumed {what} {value:?} is not a quantity")]
    Quantity {
        /// The claim's name.
        claim: String,
        /// The capacity: `memory` or `compute`.
        what: &'static str,
        /// Its text in the allocation.
        value: String,
    },
    /// The consumed `compute` is not a percent from 1 to 100.
    #[error("claim {claim}: compute {value} is not 1..100")]
    Compute {
        /// The claim's name.
        claim: String,
        /// The consumed compute, rounded up.
        value: u64,
    },
    /// This driver's opaque parameters for the claim cannot be read (an
    /// unknown field, a word or number out of range).
    #[error("claim {claim}: opaque parameters: {message}")]
    Parameters {
        /// The claim's name.
        claim: String,
        /// What is wrong with them.
        message: String,
    },
    /// The claim the API has under the kubelet's name has another UID: a
    /// claim of that name was deleted and made again.
    #[error("claim {claim}: the API says UID {actual}, the kubelet {expected}")]
    Uid {
        /// The claim's name.
        claim: String,
        /// The UID the kubelet names.
        expected: String,
        /// The UID of the object the API returned.
        actual: String,
    },
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawParameters {
    #[serde(default, rename = "apiVersion")]
    _api_version: Option<serde::de::IgnoredAny>,
    #[serde(default, rename = "kind")]
    _kind: Option<serde::de::IgnoredAny>,
    weight: Option<u32>,
    policy: Option<String>,
    ceiling: Option<u8>,
    priority: Option<i32>,
    class: Option<String>,
    oversubscribe: Option<bool>,
    spill_limit: Option<serde_json::Value>,
}

/// The request of `claim` for `driver` on `node` (whose pool has the node's
/// name), with `gpus` the node's GPUs.
pub fn to_request(
    claim: &ResourceClaim,
    driver: &str,
    node: &str,
    gpus: &[GpuInfo],
) -> Result<ClaimRequest, ClaimError> {
    let name = claim.metadata.name.clone().unwrap_or_default();
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    let status = claim.status.as_ref();
    let allocation = status
        .and_then(|s| s.allocation.as_ref())
        .and_then(|a| a.devices.as_ref())
        .ok_or_else(|| ClaimError::NotAllocated(name.clone()))?;
    let pod = quota_identity(claim).ok_or_else(|| ClaimError::NoPod(name.clone()))?;
    let configs = allocation.config.as_deref().unwrap_or_default();
    let mut devices = Vec::new();
    for result in allocation.results.as_deref().unwrap_or_default() {
        if result.driver != driver || result.pool != node {
            continue;
        }
        let gpu = slice::device_index(&result.device)
            .and_then(|index| gpus.iter().find(|g| g.index == index))
            .ok_or_else(|| ClaimError::UnknownDevice {
                claim: name.clone(),
                pool: result.pool.clone(),
                device: result.device.clone(),
            })?;
        let consumed = |key: &'static str| -> Result<Option<u64>, ClaimError> {
            let Some(q) = result.consumed_capacity.as_ref().and_then(|c| c.get(key)) else {
                return Ok(None);
            };
            quantity::parse(&q.0)
                .map(Some)
                .ok_or_else(|| ClaimError::Quantity {
                    claim: name.clone(),
                    what: key,
                    value: q.0.clone(),
                })
        };
        // Without consumable capacity (an exclusive allocation): the whole GPU.
        let memory_bytes = consumed("memory")?.unwrap_or(gpu.memory_total);
        let compute = consumed("compute")?.unwrap_or(100);
        if !(1..=100).contains(&compute) {
            return Err(ClaimError::Compute {
                claim: name.clone(),
                value: compute,
            });
        }
        devices.push(DeviceGrant {
            requests: vec![result.request.clone()],
            pool: result.pool.clone(),
            device: result.device.clone(),
            gpu_uuid: gpu.uuid.clone(),
            gpu_index: gpu.index,
            memory_bytes,
            compute_percent: compute as u8,
            params: parameters(&name, configs, driver, &result.request)?,
        });
    }
    Ok(ClaimRequest {
        claim_uid: claim.metadata.uid.clone().unwrap_or_default(),
        namespace: namespace.clone(),
        name,
        pod,
        devices,
    })
}

/// The pods `claim` is reserved for: (UID, name) of each.
pub fn consumer_pods(claim: &ResourceClaim) -> Vec<(String, String)> {
    claim
        .status
        .as_ref()
        .and_then(|s| s.reserved_for.as_ref())
        .into_iter()
        .flatten()
        .filter(|c| c.resource == "pods" && c.api_group.as_deref().unwrap_or("").is_empty())
        .map(|c| (c.uid.clone(), c.name.clone()))
        .collect()
}

/// Whose quota `claim` is (see the module's doc): its one consumer pod, or
/// the claim itself when several pods use it; `None` when no pod does.
pub fn quota_identity(claim: &ResourceClaim) -> Option<PodRef> {
    let namespace = claim.metadata.namespace.clone().unwrap_or_default();
    match consumer_pods(claim).as_slice() {
        [] => None,
        [(uid, name)] => Some(PodRef {
            uid: uid.clone(),
            namespace,
            name: name.clone(),
        }),
        _ => Some(PodRef {
            uid: claim.metadata.uid.clone().unwrap_or_default(),
            namespace,
            name: format!(
                "resourceclaim/{}",
                claim.metadata.name.as_deref().unwrap_or_default()
            ),
        }),
    }
}

/// The parameters for `request`: every config of ours that applies to it
/// (no `requests` list, or one naming it; a subrequest `req/sub` matches
/// `req`), later ones overriding earlier ones field by field.
fn parameters(
    claim: &str,
    configs: &[DeviceAllocationConfiguration],
    driver: &str,
    request: &str,
) -> Result<SharingParams, ClaimError> {
    let mut params = SharingParams::default();
    let parent = request.split('/').next().unwrap_or(request);
    let error = |message: String| ClaimError::Parameters {
        claim: claim.to_owned(),
        message,
    };
    for config in configs {
        let applies = config
            .requests
            .as_ref()
            .is_none_or(|r| r.is_empty() || r.iter().any(|n| n == request || n == parent));
        let Some(opaque) = config.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        if !applies {
            continue;
        }
        let raw: RawParameters = serde_json::from_value(opaque.parameters.0.clone())
            .map_err(|e| error(e.to_string()))?;
        if let Some(weight) = raw.weight {
            if weight == 0 {
                return Err(error("weight must be at least 1".into()));
            }
            params.weight = weight;
        }
        if let Some(policy) = raw.policy {
            params.policy = Policy::parse(&policy)
                .ok_or_else(|| error(format!("policy {policy:?} is not fixed, elastic or none")))?;
        }
        if let Some(ceiling) = raw.ceiling {
            if !(1..=100).contains(&ceiling) {
                return Err(error(format!("ceiling {ceiling} is not 1..100")));
            }
            params.ceiling = Some(ceiling);
        }
        if let Some(priority) = raw.priority {
            params.priority = priority;
        }
        if let Some(class) = raw.class {
            params.class = PodClass::parse(&class)
                .ok_or_else(|| error(format!("class {class:?} is not latency or batch")))?;
        }
        if raw.oversubscribe.is_some() || raw.spill_limit.is_some() {
            let limit = raw.spill_limit.as_ref().map(spill_limit).transpose();
            params.spill_bytes = spec::spill_cap(raw.oversubscribe, limit.map_err(error)?);
        }
    }
    Ok(params)
}

/// A `spillLimit`: bytes, or a quantity (`16Gi`).
fn spill_limit(value: &serde_json::Value) -> Result<u64, String> {
    let parsed = match value {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(text) => quantity::parse(text),
        _ => None,
    };
    parsed.ok_or_else(|| format!("spillLimit {value} is not a size"))
}

/// Checks that the claim the API has is the one the kubelet means.
pub fn check_uid(claim: &ResourceClaim, expected: &str) -> Result<(), ClaimError> {
    let actual = claim.metadata.uid.clone().unwrap_or_default();
    if actual != expected {
        return Err(ClaimError::Uid {
            claim: claim.metadata.name.clone().unwrap_or_default(),
            expected: expected.to_owned(),
            actual,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(parameters: serde_json::Value) -> DeviceAllocationConfiguration {
        serde_json::from_value(serde_json::json!({
            "source": "FromClaim",
            "opaque": {"driver": "gpu.gpushare.dev", "parameters": parameters},
        }))
        .expect("configuration")
    }

    #[test]
    fn the_class_parameter() {
        let get = |parameters| parameters_of(&[config(parameters)]);
        assert_eq!(
            get(serde_json::json!({})).map(|p| p.class),
            Ok(PodClass::Batch)
        );
        assert_eq!(
            get(serde_json::json!({"class": "latency", "weight": 2})).map(|p| (p.class, p.weight)),
            Ok((PodClass::Latency, 2))
        );
        assert!(
            get(serde_json::json!({"class": "urgent"}))
                .is_err_and(|e| e.contains("class \"urgent\" is not latency or batch"))
        );
    }

    #[test]
    fn the_oversubscription_parameters() {
        let get = |parameters| parameters_of(&[config(parameters)]).map(|p| p.spill_bytes);
        assert_eq!(get(serde_json::json!({})), Ok(0));
        assert_eq!(get(serde_json::json!({"spillLimit": "16Gi"})), Ok(16 << 30));
        assert_eq!(get(serde_json::json!({"spillLimit": 4096})), Ok(4096));
        assert_eq!(
            get(serde_json::json!({"oversubscribe": true})),
            Ok(gpushare_utils::limits::default_spill_limit())
        );
        assert_eq!(
            get(serde_json::json!({"oversubscribe": false, "spillLimit": "1Gi"})),
            Ok(0)
        );
        assert!(
            get(serde_json::json!({"spillLimit": "lots"}))
                .is_err_and(|e| e.contains("spillLimit \"lots\" is not a size"))
        );
        assert!(get(serde_json::json!({"oversubscribe": "yes"})).is_err());
    }

    fn claim(consumers: &[(&str, &str)]) -> ResourceClaim {
        let reserved: Vec<serde_json::Value> = consumers
            .iter()
            .map(|(uid, name)| serde_json::json!({"resource": "pods", "name": name, "uid": uid}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "shared", "namespace": "ml", "uid": "c1a1e000-0000-4000-8000-000000000001"},
            "spec": {"devices": {}},
            "status": {"reservedFor": reserved},
        }))
        .expect("claim")
    }

    #[test]
    fn one_consumer_is_the_quota_identity_several_share_the_claims() {
        let a = ("a0000000-0000-4000-8000-00000000000a", "trainer-a");
        let b = ("b0000000-0000-4000-8000-00000000000b", "trainer-b");
        assert_eq!(quota_identity(&claim(&[])), None);
        let one = quota_identity(&claim(&[a])).unwrap();
        assert_eq!((one.uid.as_str(), one.name.as_str()), a);
        assert_eq!(one.namespace, "ml");
        // Not the first pod's: the claim's, whichever pod starts first.
        for order in [[a, b], [b, a]] {
            let shared = quota_identity(&claim(&order)).unwrap();
            assert_eq!(shared.uid, "c1a1e000-0000-4000-8000-000000000001");
            assert_eq!(shared.name, "resourceclaim/shared");
        }
        assert_eq!(
            consumer_pods(&claim(&[a, b])),
            [a, b].map(|(u, n)| (u.to_owned(), n.to_owned()))
        );
    }

    fn parameters_of(configs: &[DeviceAllocationConfiguration]) -> Result<SharingParams, String> {
        parameters("c", configs, "gpu.gpushare.dev", "gpu").map_err(|e| e.to_string())
    }
}
