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
//! The opaque parameters are read by [`parameters`](super::parameters).
//! Every problem of every device and configuration is collected, so that a
//! refused claim says all that is wrong with it at once ([`Problem`]).

use k8s_openapi::api::resource::v1::{DeviceAllocationConfiguration, ResourceClaim};

use super::parameters::{self, ParameterProblem};
use super::slice;
use crate::quantity;
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
    /// What the claim asks of this node's devices cannot become limits:
    /// every problem found, in order.
    #[error("claim {claim}: {}", joined(.problems))]
    Invalid {
        /// The claim's name.
        claim: String,
        /// What is wrong with it.
        problems: Vec<Problem>,
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

/// One thing wrong with an allocated claim's devices of this driver.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Problem {
    /// The claim was given a device of this driver and node that matches
    /// none of the GPUs the node sees now.
    #[error("device {device} of pool {pool} is not a GPU of this node")]
    UnknownDevice {
        /// The device's pool (this node's name).
        pool: String,
        /// The device's name, `gpu-<index>` for one of ours.
        device: String,
    },
    /// A consumed capacity is not a Kubernetes quantity.
    #[error("consumed {what} {value:?} is not a quantity")]
    Quantity {
        /// The capacity: `memory` or `compute`.
        what: &'static str,
        /// Its text in the allocation.
        value: String,
    },
    /// The consumed `compute` is not a percent from 1 to 100.
    #[error("compute {0} is not 1..100")]
    Compute(u64),
    /// This driver's opaque parameters for the claim.
    #[error(transparent)]
    Parameters(#[from] ParameterProblem),
}

/// `problems`, one after the other.
fn joined(problems: &[Problem]) -> String {
    let texts: Vec<String> = problems.iter().map(Problem::to_string).collect();
    texts.join("; ")
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
    let mut problems = Vec::new();
    let mut note = |problem: Problem| {
        if !problems.contains(&problem) {
            problems.push(problem);
        }
    };
    for result in allocation.results.as_deref().unwrap_or_default() {
        if result.driver != driver || result.pool != node {
            continue;
        }
        let gpu = slice::device_index(&result.device)
            .and_then(|index| gpus.iter().find(|g| g.index == index));
        let mut consumed = |key: &'static str| -> Option<u64> {
            let q = result.consumed_capacity.as_ref()?.get(key)?;
            let parsed = quantity::parse(&q.0);
            if parsed.is_none() {
                note(Problem::Quantity {
                    what: key,
                    value: q.0.clone(),
                });
            }
            parsed
        };
        let memory = consumed("memory");
        let compute = consumed("compute");
        let (params, found) = parameters(configs, driver, &result.request);
        for problem in found {
            note(problem.into());
        }
        // Without consumable capacity (an exclusive allocation): the whole GPU.
        let compute = compute.unwrap_or(100);
        let percent = u8::try_from(compute).ok().filter(|p| (1..=100).contains(p));
        if percent.is_none() {
            note(Problem::Compute(compute));
        }
        if gpu.is_none() {
            note(Problem::UnknownDevice {
                pool: result.pool.clone(),
                device: result.device.clone(),
            });
        }
        let (Some(gpu), Some(compute_percent)) = (gpu, percent) else {
            continue;
        };
        devices.push(DeviceGrant {
            requests: vec![result.request.clone()],
            pool: result.pool.clone(),
            device: result.device.clone(),
            gpu_uuid: gpu.uuid.clone(),
            gpu_index: gpu.index,
            memory_bytes: memory.unwrap_or(gpu.memory_total),
            compute_percent,
            params,
        });
    }
    if !problems.is_empty() {
        return Err(ClaimError::Invalid {
            claim: name,
            problems,
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
/// `req`), later ones overriding earlier ones field by field; and every
/// problem of those configs.
fn parameters(
    configs: &[DeviceAllocationConfiguration],
    driver: &str,
    request: &str,
) -> (SharingParams, Vec<ParameterProblem>) {
    let mut params = SharingParams::default();
    let mut problems = Vec::new();
    let parent = request.split('/').next().unwrap_or(request);
    for config in configs {
        let applies = config
            .requests
            .as_ref()
            .is_none_or(|r| r.is_empty() || r.iter().any(|n| n == request || n == parent));
        let Some(opaque) = config.opaque.as_ref().filter(|o| o.driver == driver) else {
            continue;
        };
        if applies {
            parameters::apply(&opaque.parameters.0, &mut params, &mut problems);
        }
    }
    (params, problems)
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
    use gpushare_utils::pod::PodClass;
    use hypervisor_core::spec::Policy;

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
                .is_err_and(|e| e.contains("class \"urgent\" is not batch or latency"))
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
        let (params, problems) = parameters(configs, "gpu.gpushare.dev", "gpu");
        let problems: Vec<Problem> = problems.into_iter().map(Problem::from).collect();
        if problems.is_empty() {
            Ok(params)
        } else {
            Err(joined(&problems))
        }
    }

    /// Claim `bad` allocated on `device` with `consumed` capacity and
    /// `configs` (as the scheduler copies them), reserved for one pod.
    fn allocated(
        device: &str,
        (memory, compute): (&str, &str),
        configs: serde_json::Value,
    ) -> ResourceClaim {
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "bad", "namespace": "ml", "uid": "c1a1e000-0000-4000-8000-000000000002"},
            "spec": {"devices": {}},
            "status": {
                "allocation": {"devices": {
                    "results": [{"request": "gpu", "driver": "gpu.gpushare.dev", "pool": "node",
                        "device": device, "consumedCapacity": {"memory": memory, "compute": compute}}],
                    "config": configs,
                }},
                "reservedFor": [{"resource": "pods", "name": "p", "uid": "a0000000-0000-4000-8000-00000000000a"}],
            },
        }))
        .expect("claim")
    }

    fn gpu() -> GpuInfo {
        GpuInfo {
            index: 0,
            uuid: "GPU-0".to_owned(),
            name: "NVIDIA H100".to_owned(),
            memory_total: 80 << 30,
            memory_used: 0,
        }
    }

    #[test]
    fn every_problem_of_a_claim_is_reported_at_once() {
        let opaque = |source: &str, parameters: serde_json::Value| {
            serde_json::json!({"source": source, "requests": ["gpu"],
                "opaque": {"driver": "gpu.gpushare.dev", "parameters": parameters}})
        };
        let configs = serde_json::json!([
            opaque(
                "FromClass",
                serde_json::json!({"weight": 0, "policy": "garbage"})
            ),
            opaque(
                "FromClaim",
                serde_json::json!({"ceiling": 500, "colour": "red", "class": "batch"})
            ),
        ]);
        let claim = allocated("gpu-7", ("lots", "150"), configs);
        let error = to_request(&claim, "gpu.gpushare.dev", "node", &[gpu()]).unwrap_err();
        let ClaimError::Invalid { claim, problems } = &error else {
            panic!("{error}");
        };
        assert_eq!(claim, "bad");
        let invalid = |field, value: &str, allowed| {
            Problem::Parameters(ParameterProblem::Invalid {
                field,
                value: value.to_owned(),
                allowed,
            })
        };
        assert_eq!(
            problems,
            &[
                Problem::Quantity {
                    what: "memory",
                    value: "lots".to_owned()
                },
                invalid("weight", "0", "a whole number from 1 to 4294967295"),
                invalid("policy", "\"garbage\"", "fixed, elastic or none"),
                Problem::Parameters(ParameterProblem::UnknownField("colour".to_owned())),
                invalid("ceiling", "500", "a whole number from 1 to 100"),
                Problem::Compute(150),
                Problem::UnknownDevice {
                    pool: "node".to_owned(),
                    device: "gpu-7".to_owned()
                },
            ]
        );
        // One line, in the product's words: no parser's types.
        let text = error.to_string();
        assert!(
            text.starts_with("claim bad: consumed memory \"lots\" is not a quantity; opaque parameters: weight 0 is not a whole number from 1 to 4294967295; "),
            "{text}"
        );
        assert!(!text.contains("u8") && !text.contains("expected"), "{text}");
    }

    #[test]
    fn a_claim_without_problems_is_a_request() {
        let configs = serde_json::json!([{"source": "FromClaim",
            "opaque": {"driver": "gpu.gpushare.dev", "parameters": {"weight": 3, "policy": "elastic", "ceiling": 80}}}]);
        let claim = allocated("gpu-0", ("4Gi", "30"), configs);
        let request = to_request(&claim, "gpu.gpushare.dev", "node", &[gpu()]).unwrap();
        let [device] = request.devices.as_slice() else {
            panic!("{request:?}");
        };
        assert_eq!((device.memory_bytes, device.compute_percent), (4 << 30, 30));
        let p = &device.params;
        assert_eq!(
            (p.weight, p.policy, p.ceiling),
            (3, Policy::Elastic, Some(80))
        );
    }
}
