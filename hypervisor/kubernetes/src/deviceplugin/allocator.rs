//! The device plugin's side of the agent: which container an `Allocate` is
//! for, its claim made from the pod's resource names and provisioned like a
//! DRA claim, the refusal as an event on the pod, and the node capacity of
//! the memory and compute names so the default scheduler admits such pods.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, ObjectReference, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams};
use serde_json::json;

use super::ask::{self, CORES, MEMORY_MIB, MEMORY_PERCENT};
use super::placement::{self, GpuLoad};
use super::{AllocateError, Allocator, GpuHealth, SharesMismatch, podresources};
use crate::KubeError;
use crate::NodeAgent;
use crate::state::EventKind;
use gpushare_utils::logging::one_line;
use hypervisor_config::MemoryCapacity;
use hypervisor_core::spec::Policy;
use hypervisor_observer::{GpuInfo, Unhealthy};
use hypervisor_provision::cdi::ContainerEdits;
use hypervisor_provision::{ClaimRequest, DeviceGrant, PodRef, SharingParams, new_uid};

/// `reason` of the Warning event on a pod whose container was refused its
/// shares; the message says why.
pub const REFUSED: &str = "GpuShareAllocationFailed";
/// `reason` of the Normal event on a pod whose container got its shares;
/// the message names each GPU with its MiB and percent.
pub const ALLOCATED: &str = "GpuShareAllocated";
const COMPONENT: &str = "gpushare-device-plugin";

/// The GPUs seen now, healthy unless in `unhealthy` (by UUID); those
/// advertised before and gone, unhealthy.
pub fn health(
    gpus: &[GpuInfo],
    before: &[GpuHealth],
    unhealthy: &BTreeMap<String, Unhealthy>,
) -> Vec<GpuHealth> {
    let mut health: Vec<GpuHealth> = gpus
        .iter()
        .map(|g| GpuHealth {
            uuid: g.uuid.clone(),
            healthy: !unhealthy.contains_key(&g.uuid),
        })
        .collect();
    for old in before {
        if !health.iter().any(|h| h.uuid == old.uuid) {
            health.push(GpuHealth {
                uuid: old.uuid.clone(),
                healthy: false,
            });
        }
    }
    health
}

/// Advertises the memory (MiB) and compute (percent) names as capacity of
/// `node`: without them the default scheduler refuses pods that name them.
/// Allocatable leaves out the GPUs in `unhealthy`, as the kubelet does for
/// the shares.
pub async fn advertise_capacity(
    client: &kube::Client,
    node: &str,
    gpus: &[GpuInfo],
    unhealthy: &BTreeMap<String, Unhealthy>,
    memory: &MemoryCapacity,
) -> Result<(), KubeError> {
    let patch = capacity_patch(gpus, unhealthy, memory);
    Api::<Node>::all(client.clone())
        .patch_status(node, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(KubeError::api("patch node capacity"))?;
    Ok(())
}

/// The node status patch of [`advertise_capacity`]. A GPU that overcommits
/// counts its memory times the ratio, in MiB and in percent of its memory
/// (150 at 1.5), as the placement does; compute is 100 a GPU.
fn capacity_patch(
    gpus: &[GpuInfo],
    unhealthy: &BTreeMap<String, Unhealthy>,
    memory: &MemoryCapacity,
) -> serde_json::Value {
    let names = |gpus: &[&GpuInfo]| {
        let mib: u64 = gpus
            .iter()
            .map(|g| memory.of(g.index, g.memory_total) >> 20)
            .sum();
        let memory_percent: u64 = gpus.iter().map(|g| memory.of(g.index, 100)).sum();
        let percent = 100 * gpus.len() as u64;
        let mut names = serde_json::Map::new();
        for name in MEMORY_MIB {
            names.insert(name.to_owned(), json!(mib.to_string()));
        }
        names.insert(MEMORY_PERCENT.to_owned(), json!(memory_percent.to_string()));
        for name in CORES {
            names.insert(name.to_owned(), json!(percent.to_string()));
        }
        names
    };
    let all: Vec<&GpuInfo> = gpus.iter().collect();
    let healthy: Vec<&GpuInfo> = gpus
        .iter()
        .filter(|g| !unhealthy.contains_key(&g.uuid))
        .collect();
    json!({"status": {"capacity": names(&all), "allocatable": names(&healthy)}})
}

/// The container an `Allocate` of `count` shares is for.
struct Target {
    pod: Pod,
    container: String,
}

impl NodeAgent {
    /// The pods of this node that may be starting: not finished, not
    /// deleted, oldest first.
    async fn starting_pods(&self) -> Result<Vec<Pod>, AllocateError> {
        let node = &self.inner.options.node;
        let pods = Api::<Pod>::all(self.inner.client.clone())
            .list(&ListParams::default().fields(&format!("spec.nodeName={node}")))
            .await
            .map_err(|source| AllocateError::Pods {
                node: node.clone(),
                source,
            })?;
        let mut pods: Vec<Pod> = pods
            .items
            .into_iter()
            .filter(|p| p.metadata.deletion_timestamp.is_none())
            .filter(|p| {
                !matches!(
                    p.status.as_ref().and_then(|s| s.phase.as_deref()),
                    Some("Succeeded" | "Failed")
                )
            })
            .collect();
        pods.sort_by(|a, b| {
            (&a.metadata.creation_timestamp, &a.metadata.name)
                .cmp(&(&b.metadata.creation_timestamp, &b.metadata.name))
        });
        Ok(pods)
    }

    /// Whether container `container` of pod `uid` has a claim already.
    fn provisioned(&self, uid: &str, container: &str) -> Option<String> {
        self.provisioner()
            .claims()
            .values()
            .find(|c| c.request.pod.uid == uid && c.request.name == container)
            .map(|c| c.request.claim_uid.clone())
    }

    /// Finds the container: the one the kubelet says holds `devices`; else
    /// the first (oldest pod first) that asks for `devices.len()` of
    /// `resource`, has no claim yet, is not served in the kubelet's
    /// pod-resources and, when that list exists, belongs to a pod in it.
    async fn target(&self, resource: &str, devices: &[String]) -> Result<Target, AllocateError> {
        let listed = podresources::list(&self.inner.options_device_plugin()?.pod_resources)
            .await
            .unwrap_or_else(|error| {
                tracing::warn!(%error, "pod-resources unavailable: matching pending pods");
                None
            });
        let pods = self.starting_pods().await?;
        let key = |p: &Pod| {
            (
                p.metadata.namespace.clone().unwrap_or_default(),
                p.metadata.name.clone().unwrap_or_default(),
            )
        };
        if let Some(list) = &listed
            && let Some((ns, name, container)) = podresources::holder(list, resource, devices)
            && let Some(pod) = pods
                .iter()
                .find(|p| key(p) == (ns.to_owned(), name.to_owned()))
        {
            return Ok(Target {
                pod: pod.clone(),
                container: container.to_owned(),
            });
        }
        for pod in &pods {
            let (ns, name) = key(pod);
            let uid = pod.metadata.uid.clone().unwrap_or_default();
            if let Some(list) = &listed
                && !list.iter().any(|p| p.namespace == ns && p.name == name)
            {
                continue;
            }
            let containers = pod.spec.iter().flat_map(|s| &s.containers);
            for container in containers {
                let Ok(Some(asked)) = ask::container_ask(container, resource) else {
                    continue;
                };
                if asked.count as usize != devices.len()
                    || self.provisioned(&uid, &container.name).is_some()
                    || listed.as_ref().is_some_and(|l| {
                        podresources::served(l, resource, &ns, &name, &container.name)
                    })
                {
                    continue;
                }
                return Ok(Target {
                    pod: pod.clone(),
                    container: container.name.clone(),
                });
            }
        }
        Err(AllocateError::NoContainer {
            node: self.inner.options.node.clone(),
            count: devices.len(),
            resource: resource.to_owned(),
        })
    }

    /// The claim of `target`, placed on this node's GPUs.
    fn device_claim(&self, resource: &str, target: &Target) -> Result<ClaimRequest, AllocateError> {
        let pod = &target.pod;
        let container = pod
            .spec
            .iter()
            .flat_map(|s| &s.containers)
            .find(|c| c.name == target.container)
            .ok_or_else(|| AllocateError::NoSuchContainer(target.container.clone()))?;
        let asked =
            ask::container_ask(container, resource)?.ok_or_else(|| AllocateError::NoAsk {
                container: container.name.clone(),
                resource: resource.to_owned(),
            })?;
        let prefs = ask::pod_prefs(pod)?;
        // An unhealthy GPU takes no new container, whichever share the
        // kubelet picked.
        let unhealthy = self.inner.hv.unhealthy_gpus();
        let pod_uid = pod.metadata.uid.as_deref().unwrap_or_default();
        let (loads, pod_gpus): (Vec<GpuLoad>, Vec<String>) = {
            let provisioner = self.provisioner();
            let corun = provisioner.config().corun.as_ref();
            let loads = provisioner
                .gpus()
                .iter()
                .filter(|g| !unhealthy.contains_key(&g.uuid))
                .map(|g| {
                    let (memory_held, compute_held) = provisioner.held(&g.uuid);
                    GpuLoad {
                        index: g.index,
                        uuid: g.uuid.clone(),
                        name: g.name.clone(),
                        memory_total: g.memory_total,
                        memory_capacity: provisioner.memory_capacity(g),
                        memory_held,
                        compute_held,
                        corun: corun.is_some_and(|c| c.covers(&g.uuid)),
                    }
                })
                .collect();
            // The GPUs the pod's other containers were given.
            let pod_gpus = provisioner
                .claims()
                .values()
                .filter(|c| c.request.pod.uid == pod_uid)
                .flat_map(|c| c.request.devices.iter().map(|d| d.gpu_uuid.clone()))
                .collect();
            (loads, pod_gpus)
        };
        let placed = placement::place(&asked, &prefs, &loads, &pod_gpus)?;
        let policy = if asked.cores.is_none() {
            Policy::None
        } else {
            prefs.policy
        };
        let node = &self.inner.options.node;
        Ok(ClaimRequest {
            claim_uid: new_uid()?,
            namespace: pod.metadata.namespace.clone().unwrap_or_default(),
            name: container.name.clone(),
            pod: PodRef {
                uid: pod.metadata.uid.clone().unwrap_or_default(),
                namespace: pod.metadata.namespace.clone().unwrap_or_default(),
                name: pod.metadata.name.clone().unwrap_or_default(),
            },
            devices: placed
                .into_iter()
                .map(|p| DeviceGrant {
                    requests: vec![resource.to_owned()],
                    pool: node.clone(),
                    device: format!("gpu-{}", p.index),
                    gpu_uuid: p.uuid,
                    gpu_index: p.index,
                    memory_bytes: p.memory_bytes,
                    compute_percent: p.compute_percent,
                    params: SharingParams {
                        policy,
                        class: prefs.class,
                        spill_bytes: prefs.spill_bytes,
                        ..SharingParams::default()
                    },
                })
                .collect(),
        })
    }

    /// Records an event on `pod` (failures to do so only logged).
    async fn event(&self, pod: &Pod, warning: bool, reason: &str, message: &str) {
        let about = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Pod".into()),
            name: pod.metadata.name.clone(),
            namespace: pod.metadata.namespace.clone(),
            uid: pod.metadata.uid.clone(),
            ..Default::default()
        };
        let kind = if warning {
            EventKind::Warning
        } else {
            EventKind::Normal
        };
        self.record_event(about, COMPONENT, (kind, reason), message)
            .await;
    }
}

impl Allocator for NodeAgent {
    async fn allocate(
        &self,
        resource: &str,
        devices: Vec<String>,
    ) -> Result<ContainerEdits, AllocateError> {
        let _busy = self.inner.busy.lock().await;
        let target = self.target(resource, &devices).await?;
        let uid = target.pod.metadata.uid.clone().unwrap_or_default();
        let claim_uid = match self.provisioned(&uid, &target.container) {
            // Asked again (the kubelet retried): the same answer.
            Some(claim) => claim,
            None => {
                let request = match self.device_claim(resource, &target) {
                    Ok(request) => request,
                    Err(why) => {
                        self.event(&target.pod, true, REFUSED, &one_line(&why))
                            .await;
                        return Err(why);
                    }
                };
                if let Err(why) = self.provision(&request) {
                    self.event(&target.pod, true, REFUSED, &one_line(&why))
                        .await;
                    return Err(why.into());
                }
                let gpus: Vec<String> = request
                    .devices
                    .iter()
                    .map(|d| {
                        format!(
                            "{} ({} MiB, {}%)",
                            d.gpu_uuid,
                            d.memory_bytes >> 20,
                            d.compute_percent
                        )
                    })
                    .collect();
                let message = format!("container {}: {}", target.container, gpus.join(", "));
                self.event(&target.pod, false, ALLOCATED, &message).await;
                request.claim_uid
            }
        };
        let mut key = devices;
        key.sort();
        if let Ok(mut allocated) = self.inner.allocated.lock() {
            allocated.insert(key, (uid, target.container.clone()));
        }
        Ok(self.provisioner().container_edits(&claim_uid)?)
    }

    async fn pre_start(&self, resource: &str, devices: Vec<String>) -> Result<(), AllocateError> {
        let mut key = devices.clone();
        key.sort();
        let Some((uid, container)) = self
            .inner
            .allocated
            .lock()
            .ok()
            .and_then(|mut a| a.remove(&key))
        else {
            return Ok(());
        };
        let config = self.inner.options_device_plugin()?;
        let Ok(Some(list)) = podresources::list(&config.pod_resources).await else {
            return Ok(());
        };
        let Some((ns, name, holder)) = podresources::holder(&list, resource, &devices) else {
            return Ok(());
        };
        let pods = self.starting_pods().await?;
        let pod = pods.iter().find(|p| {
            p.metadata.namespace.as_deref() == Some(ns) && p.metadata.name.as_deref() == Some(name)
        });
        if pod.and_then(|p| p.metadata.uid.as_deref()) == Some(uid.as_str()) && holder == container
        {
            return Ok(());
        }
        // Fail closed: these devices went to a container other than the one
        // whose limits were provisioned.
        Err(AllocateError::Mismatch(Box::new(SharesMismatch {
            devices,
            namespace: ns.to_owned(),
            name: name.to_owned(),
            holder: holder.to_owned(),
            uid,
            container,
        })))
    }
}

impl crate::state::Inner {
    fn options_device_plugin(&self) -> Result<&super::DevicePluginConfig, AllocateError> {
        self.options
            .device_plugin
            .as_ref()
            .ok_or(AllocateError::Off)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypervisor_config::OvercommitRatio;
    use hypervisor_observer::Fault;

    #[test]
    fn an_overcommitting_gpu_counts_its_memory_times_the_ratio() {
        let gpus: Vec<GpuInfo> = (0..2)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-{index}"),
                name: "test".into(),
                memory_total: 16 << 30,
                memory_used: 0,
            })
            .collect();
        let memory = MemoryCapacity::new(Some(vec![0]), OvercommitRatio::new(1.5).unwrap());
        let unhealthy = BTreeMap::from([(
            "GPU-1".to_owned(),
            Unhealthy {
                fault: Fault::Lost,
                since: 0,
            },
        )]);
        let patch = capacity_patch(&gpus, &unhealthy, &memory);
        let status = &patch["status"];
        // 24 GiB + 16 GiB, and GPU 0's 24 GiB alone once GPU 1 is lost.
        for name in MEMORY_MIB {
            assert_eq!(status["capacity"][name], "40960", "{name}");
            assert_eq!(status["allocatable"][name], "24576", "{name}");
        }
        assert_eq!(status["capacity"][MEMORY_PERCENT], "250");
        assert_eq!(status["allocatable"][MEMORY_PERCENT], "150");
        for name in CORES {
            assert_eq!(status["capacity"][name], "200", "{name}");
        }
        let own = capacity_patch(&gpus, &BTreeMap::new(), &MemoryCapacity::NONE);
        assert_eq!(own["status"]["capacity"][MEMORY_MIB[0]], "32768");
        assert_eq!(own["status"]["capacity"][MEMORY_PERCENT], "200");
    }
}
