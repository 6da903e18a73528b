//! The node's ResourceSlice: every GPU one device, shareable by several
//! claims (KEP-5075 consumable capacity), each consuming part of its
//! `memory` (bytes) and `compute` (percent).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use k8s_openapi::api::resource::v1::{
    CapacityRequestPolicy, CapacityRequestPolicyRange, Device, DeviceAttribute, DeviceCapacity,
    ResourcePool, ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, OwnerReference};
use kube::api::{Api, PostParams};

use super::KubeError;
use crate::observer::GpuInfo;

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

/// The slice of `node` for `gpus`. A claim that names no capacity takes a
/// whole GPU (the defaults); one that does takes what it asks, rounded up to
/// 256 MiB of memory and whole percents.
pub fn build(node: &str, driver: &str, gpus: &[GpuInfo], owner: Option<&Node>) -> ResourceSlice {
    let devices = gpus
        .iter()
        .map(|gpu| {
            let usable = gpu.memory_total - gpu.memory_total % MEMORY_STEP;
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
            let mut capacity = BTreeMap::new();
            capacity.insert(
                "memory".to_owned(),
                DeviceCapacity {
                    value: Quantity(usable.to_string()),
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

/// Creates the slice, or replaces it when its devices changed (the pool's
/// generation then goes up, as the scheduler expects).
pub async fn publish(
    client: &kube::Client,
    node: &str,
    driver: &str,
    gpus: &[GpuInfo],
) -> Result<ResourceSlice, KubeError> {
    let nodes: Api<Node> = Api::all(client.clone());
    let owner = nodes
        .get_opt(node)
        .await
        .map_err(KubeError::api("get node"))?;
    let mut wanted = build(node, driver, gpus, owner.as_ref());
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
        Some(current) if current.spec.devices == wanted.spec.devices => Ok(current),
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
