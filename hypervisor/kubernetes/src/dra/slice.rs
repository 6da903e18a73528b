//! The node's ResourceSlice: every GPU one device, shareable by several
//! claims (KEP-5075 consumable capacity), each consuming part of its
//! `memory` (bytes) and `compute` (percent). An unhealthy GPU carries a
//! device taint `<driver>/unhealthy=<reason>` (KEP-5055, beta behind the
//! `DRADeviceTaints` gate): `NoExecute` when its work cannot go on (lost,
//! XID 79), else `NoSchedule`. Every device says whether its GPU is in
//! co-run mode (the boolean attribute [`CORUN_ATTRIBUTE`]), so a claim can
//! ask for one, or avoid one, with CEL:
//! `device.attributes["<driver>"].corun == true`.
//!
//! Memory overcommit: a GPU that overcommits (`[swap] overcommit` of the
//! daemon) advertises its memory times `[swap] overcommit_ratio` as its
//! `memory` capacity, so the scheduler places quotas adding up to that much;
//! the daemon makes the room by swapping idle pods out. One request still
//! takes at most the GPU's own memory (the request policy's maximum), and
//! such a device carries the boolean attribute [`OVERCOMMIT_ATTRIBUTE`], so
//! that a pod that must never be swapped can avoid it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    DeviceTaint, ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference, Time};
use kube::api::{Api, PostParams};

use crate::KubeError;
use hypervisor_config::MemoryCapacity;
use hypervisor_corun::CorunOptions;
use hypervisor_observer::{GpuInfo, Unhealthy};

/// The boolean device attribute: true on co-run (MPS) GPUs.
pub const CORUN_ATTRIBUTE: &str = "corun";

/// The boolean device attribute: true on GPUs whose memory is overcommitted.
pub const OVERCOMMIT_ATTRIBUTE: &str = "overcommit";

/// The key of the unhealthy taint under the driver's name.
pub const UNHEALTHY_KEY: &str = "unhealthy";

/// Smallest memory part a claim may take, and its step.
pub const MEMORY_STEP: u64 = 256 << 20;

/// The name of the device for GPU `index` (`gpu-0`).
pub fn device_name(index: u32) -> String {
    format!("gpu-{index}")
}

/// The GPU index of device `name`, if it is one of ours.
pub fn device_index(name: &str) -> Option<u32> {
    name.strip_prefix("gpu-")?.parse().ok()
}

/// The slice's name: `<node>-<driver>`.
pub fn slice_name(node: &str, driver: &str) -> String {
    format!("{node}-{driver}")
}

/// The taint of a GPU that is `unhealthy`.
pub fn taint(driver: &str, unhealthy: &Unhealthy) -> DeviceTaint {
    DeviceTaint {
        key: format!("{driver}/{UNHEALTHY_KEY}"),
        value: Some(unhealthy.fault.reason()),
        effect: if unhealthy.fault.evicts() {
            "NoExecute"
        } else {
            "NoSchedule"
        }
        .to_owned(),
        time_added: k8s_openapi::jiff::Timestamp::from_second(unhealthy.since)
            .ok()
            .map(Time),
    }
}

/// What the node advertises of each GPU besides its identity.
#[derive(Debug, Clone, Copy)]
pub struct Offer<'a> {
    /// The GPUs that are unhealthy, by UUID: tainted.
    pub unhealthy: &'a BTreeMap<String, Unhealthy>,
    /// The co-run GPUs: marked `corun: true`.
    pub corun: Option<&'a CorunOptions>,
    /// The memory each GPU offers to quotas: its `memory` capacity.
    pub memory: &'a MemoryCapacity,
}

/// `bytes` rounded down to the memory step.
fn in_steps(bytes: u64) -> u64 {
    bytes - bytes % MEMORY_STEP
}

/// The slice of `node` for `gpus`, as `offer` says. A claim that names no
/// capacity takes a whole GPU (the defaults); one that does takes what it
/// asks, rounded up to 256 MiB of memory and whole percents, at most the
/// GPU's own memory, whatever the device's capacity.
pub fn build(
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
    offer: Offer<'_>,
    owner: Option<&Node>,
) -> ResourceSlice {
    let Offer {
        unhealthy,
        corun,
        memory,
    } = offer;
    let devices = gpus
        .iter()
        .map(|gpu| {
            let usable = in_steps(gpu.memory_total);
            let offered = in_steps(memory.of(gpu.index, gpu.memory_total)).max(usable);
            let mut attributes = BTreeMap::new();
            attributes.insert("uuid".to_owned(), text_attr(&gpu.uuid));
            attributes.insert("model".to_owned(), text_attr(&gpu.name));
            attributes.insert(
                "index".to_owned(),
                DeviceAttribute {
                    int: Some(i64::from(gpu.index)),
                    ..DeviceAttribute::default()
                },
            );
            attributes.insert(
                CORUN_ATTRIBUTE.to_owned(),
                DeviceAttribute {
                    bool: Some(corun.is_some_and(|c| c.covers(&gpu.uuid))),
                    ..DeviceAttribute::default()
                },
            );
            attributes.insert(
                OVERCOMMIT_ATTRIBUTE.to_owned(),
                DeviceAttribute {
                    bool: Some(offered > usable),
                    ..DeviceAttribute::default()
                },
            );
            let mut capacity = BTreeMap::new();
            capacity.insert(
                "memory".to_owned(),
                DeviceCapacity {
                    value: Quantity(offered.to_string()),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(Quantity(usable.to_string())),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: Quantity(MEMORY_STEP.to_string()),
                            max: Some(Quantity(usable.to_string())),
                            step: Some(Quantity(MEMORY_STEP.to_string())),
                        }),
                        valid_values: None,
                    }),
                },
            );
            capacity.insert(
                "compute".to_owned(),
                DeviceCapacity {
                    value: Quantity("100".to_owned()),
                    request_policy: Some(CapacityRequestPolicy {
                        default: Some(Quantity("100".to_owned())),
                        valid_range: Some(CapacityRequestPolicyRange {
                            min: Quantity("1".to_owned()),
                            max: Some(Quantity("100".to_owned())),
                            step: Some(Quantity("1".to_owned())),
                        }),
                        valid_values: None,
                    }),
                },
            );
            Device {
                name: device_name(gpu.index),
                attributes: Some(attributes),
                capacity: Some(capacity),
                allow_multiple_allocations: Some(true),
                taints: unhealthy.get(&gpu.uuid).map(|u| vec![taint(driver, u)]),
                ..Device::default()
            }
        })
        .collect();
    let owner_references = owner.and_then(|node| {
        Some(vec![OwnerReference {
            api_version: "v1".to_owned(),
            kind: "Node".to_owned(),
            name: node.metadata.name.clone()?,
            uid: node.metadata.uid.clone()?,
            controller: Some(true),
            block_owner_deletion: None,
        }])
    });
    ResourceSlice {
        metadata: ObjectMeta {
            name: Some(slice_name(node, driver)),
            owner_references,
            ..ObjectMeta::default()
        },
        spec: ResourceSliceSpec {
            driver: driver.to_owned(),
            node_name: Some(node.to_owned()),
            pool: ResourcePool {
                name: node.to_owned(),
                generation: 1,
                resource_slice_count: 1,
            },
            devices: Some(devices),
            ..ResourceSliceSpec::default()
        },
    }
}

fn text_attr(value: &str) -> DeviceAttribute {
    DeviceAttribute {
        string: Some(value.to_owned()),
        ..DeviceAttribute::default()
    }
}

/// Whether any device of `slice` carries a taint.
pub fn has_taints(slice: &ResourceSlice) -> bool {
    slice
        .spec
        .devices
        .iter()
        .flatten()
        .any(|d| d.taints.as_ref().is_some_and(|t| !t.is_empty()))
}

/// Whether `a` and `b` list the same devices, the times taints were added
/// aside (the API server fills those it is not given, and keeps seconds only).
fn same_devices(a: &ResourceSlice, b: &ResourceSlice) -> bool {
    let untimed = |slice: &ResourceSlice| {
        let mut devices = slice.spec.devices.clone().unwrap_or_default();
        for taint in devices
            .iter_mut()
            .flat_map(|d| d.taints.iter_mut().flatten())
        {
            taint.time_added = None;
        }
        devices
    };
    untimed(a) == untimed(b)
}

/// Creates the slice, or replaces it when its devices changed (the pool's
/// generation then goes up, as the scheduler expects), as `offer` says.
/// Returns the slice as the API server stored it: without taints where
/// `DRADeviceTaints` is off there.
pub async fn publish(
    client: &kube::Client,
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
    offer: Offer<'_>,
) -> Result<ResourceSlice, KubeError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let owner = nodes
        .get_opt(node)
        .await
        .map_err(KubeError::api("get node"))?;
    let mut wanted = build(node, driver, gpus, offer, owner.as_ref());
    let slices: Api<ResourceSlice> = Api::all(client.clone());
    let name = slice_name(node, driver);
    match slices
        .get_opt(&name)
        .await
        .map_err(KubeError::api("get resourceslice"))?
    {
        None => slices
            .create(&PostParams::default(), &wanted)
            .await
            .map_err(KubeError::api("create resourceslice")),
        // Unchanged devices and owner: nothing to write. A slice published
        // before its Node existed gets the Node as owner once it does, so
        // that the garbage collector removes it with the Node.
        Some(current)
            if same_devices(&current, &wanted)
                && current.metadata.owner_references == wanted.metadata.owner_references =>
        {
            Ok(current)
        }
        Some(current) => {
            wanted.spec.pool.generation = current.spec.pool.generation + 1;
            wanted.metadata.resource_version = current.metadata.resource_version;
            slices
                .replace(&name, &PostParams::default(), &wanted)
                .await
                .map_err(KubeError::api("replace resourceslice"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hypervisor_observer::{Fault, GpuObserver, SimulatedGpus};

    #[test]
    fn unhealthy_gpus_are_tainted_alone() {
        let gpus = SimulatedGpus::new(2).gpus().unwrap();
        let since = 1_700_000_000;
        let unhealthy = BTreeMap::from([(
            gpus[1].uuid.clone(),
            Unhealthy {
                fault: Fault::Xid(Some(48)),
                since,
            },
        )]);
        let slice = build("n", "gpu.example.com", &gpus, offer(&unhealthy, None), None);
        assert!(has_taints(&slice));
        let devices = slice.spec.devices.as_deref().unwrap();
        assert_eq!(devices[0].taints, None);
        let taint = &devices[1].taints.as_deref().unwrap()[0];
        assert_eq!(
            (
                taint.key.as_str(),
                taint.value.as_deref(),
                taint.effect.as_str()
            ),
            ("gpu.example.com/unhealthy", Some("xid-48"), "NoSchedule")
        );
        assert_eq!(taint.time_added.as_ref().unwrap().0.as_second(), since);
        let lost = Unhealthy {
            fault: Fault::Lost,
            since,
        };
        assert_eq!(taint_for(&lost).effect, "NoExecute");

        // The server's own times do not make the devices differ; the taints do.
        let mut stored = slice.clone();
        for t in stored
            .spec
            .devices
            .iter_mut()
            .flatten()
            .flat_map(|d| d.taints.iter_mut().flatten())
        {
            t.time_added = None;
        }
        assert!(same_devices(&slice, &stored));
        let healthy = build(
            "n",
            "gpu.example.com",
            &gpus,
            offer(&BTreeMap::new(), None),
            None,
        );
        assert!(!has_taints(&healthy) && !same_devices(&slice, &healthy));
    }

    #[test]
    fn corun_gpus_carry_the_attribute() {
        let gpus = SimulatedGpus::new(2).gpus().unwrap();
        let corun = CorunOptions {
            gpus: vec![gpus[1].uuid.clone()],
            dir: "/run/gpushare/mps".into(),
            host_dir: "/run/gpushare/mps".into(),
            latency_reserve: hypervisor_corun::DEFAULT_LATENCY_RESERVE,
            control: hypervisor_corun::DEFAULT_MPS_CONTROL.into(),
            private_shm: true,
        };
        let flags = |corun: Option<&CorunOptions>| -> Vec<Option<bool>> {
            build("n", "d", &gpus, offer(&BTreeMap::new(), corun), None)
                .spec
                .devices
                .unwrap_or_default()
                .iter()
                .map(|d| d.attributes.as_ref().and_then(|a| a[CORUN_ATTRIBUTE].bool))
                .collect()
        };
        assert_eq!(flags(Some(&corun)), [Some(false), Some(true)]);
        assert_eq!(flags(None), [Some(false), Some(false)]);
    }

    /// No GPU overcommits.
    const OWN_MEMORY: &MemoryCapacity = &MemoryCapacity::NONE;

    fn offer<'a>(
        unhealthy: &'a BTreeMap<String, Unhealthy>,
        corun: Option<&'a CorunOptions>,
    ) -> Offer<'a> {
        Offer {
            unhealthy,
            corun,
            memory: OWN_MEMORY,
        }
    }

    #[test]
    fn an_overcommitting_gpu_offers_its_memory_times_the_ratio_and_one_request_its_memory() {
        const GIB: u64 = 1 << 30;
        let gpus: Vec<GpuInfo> = (0..2)
            .map(|index| GpuInfo {
                index,
                uuid: format!("GPU-{index}"),
                name: "test".into(),
                // Not a whole number of steps: each figure is rounded down.
                memory_total: 16 * GIB + 100,
                memory_used: 0,
            })
            .collect();
        let ratio = hypervisor_config::OvercommitRatio::new(1.5).unwrap();
        let memory = MemoryCapacity::new(Some(vec![0]), ratio);
        let unhealthy = BTreeMap::new();
        let slice = build(
            "n",
            "d",
            &gpus,
            Offer {
                unhealthy: &unhealthy,
                corun: None,
                memory: &memory,
            },
            None,
        );
        let devices = slice.spec.devices.unwrap();
        let figures: Vec<(String, String, String, Option<bool>)> = devices
            .iter()
            .map(|d| {
                let memory = &d.capacity.as_ref().unwrap()["memory"];
                let policy = memory.request_policy.as_ref().unwrap();
                (
                    memory.value.0.clone(),
                    policy.default.as_ref().unwrap().0.clone(),
                    policy
                        .valid_range
                        .as_ref()
                        .unwrap()
                        .max
                        .as_ref()
                        .unwrap()
                        .0
                        .clone(),
                    d.attributes.as_ref().unwrap()[OVERCOMMIT_ATTRIBUTE].bool,
                )
            })
            .collect();
        let (whole, offered) = ((16 * GIB).to_string(), (24 * GIB).to_string());
        assert_eq!(
            figures,
            [
                // Capacity 1.5 times; one request, by default or at most,
                // the GPU's own memory.
                (offered, whole.clone(), whole.clone(), Some(true)),
                (whole.clone(), whole.clone(), whole, Some(false)),
            ]
        );
    }

    fn taint_for(unhealthy: &Unhealthy) -> DeviceTaint {
        taint("gpu.example.com", unhealthy)
    }
}
