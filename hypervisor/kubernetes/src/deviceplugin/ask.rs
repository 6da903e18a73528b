//! What a pod asks for, in the resource names and annotations of the systems
//! people migrate from, with their units:
//!
//! | where | name | meaning |
//! | --- | --- | --- |
//! | limits | `nvidia.com/gpu` (HAMi), `nvidia.com/vgpu-number` (vgpu-manager) | GPUs (the plugin's resource) |
//! | limits | `nvidia.com/gpumem`, `nvidia.com/vgpu-memory` | MiB per GPU |
//! | limits | `nvidia.com/gpumem-percentage` | percent of each GPU's memory |
//! | limits | `nvidia.com/gpucores`, `nvidia.com/vgpu-cores` | percent of each GPU's compute |
//! | annotation | `nvidia.com/use-gpuuuid`, `nvidia.com/include-gpu-uuid` | only these GPUs (comma-separated) |
//! | annotation | `nvidia.com/nouse-gpuuuid`, `nvidia.com/exclude-gpu-uuid` | never these |
//! | annotation | `nvidia.com/use-gputype`, `nvidia.com/include-gpu-type` | only GPUs whose name contains one of these |
//! | annotation | `nvidia.com/nouse-gputype`, `nvidia.com/exclude-gpu-type` | none whose name contains one |
//! | annotation | `hami.io/gpu-scheduler-policy`, `nvidia.com/device-scheduler-policy` | `binpack` (default) or `spread` |
//! | annotation | `nvidia.com/vgpu-compute-policy` | `fixed` (default), `balance` (elastic), `none` |
//! | annotation | `gpushare.dev/class` | `batch` (default) or `latency` (served first on its GPUs) |
//! | annotation | `gpushare.dev/corun` | `true`: only co-run GPUs (MPS clients); `false`: none; default: either, never mixed |
//! | annotation | `gpushare.dev/oversubscribe` | `true`: past the quota, linear allocations are served from pinned host memory (default `false`) |
//! | annotation | `gpushare.dev/spill-limit` | that host memory's pod-wide cap per GPU, a quantity (`16Gi`); implies oversubscription; default with it: a quarter of the node's memory; `0`: none |
//!
//! Without a memory limit a container gets whole GPUs' memory (HAMi's
//! default); without a compute limit, no compute limit (HAMi's `gpucores: 0`).

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Container, Pod};

use gpushare_utils::pod::PodClass;
use gpushare_utils::units::parse_switch;

use crate::quantity;
use hypervisor_core::spec::{self, Policy};

/// Limits naming memory per GPU in MiB (HAMi's, vgpu-manager's); either
/// wins over [`MEMORY_PERCENT`]. Also advertised as node capacity: the
/// node's memory in MiB.
pub const MEMORY_MIB: [&str; 2] = ["nvidia.com/gpumem", "nvidia.com/vgpu-memory"];
/// Limit naming memory as a percent of each GPU's (1..=100). Also
/// advertised as node capacity: 100 per GPU.
pub const MEMORY_PERCENT: &str = "nvidia.com/gpumem-percentage";
/// Limits naming compute as a percent of each GPU (0..=100; 0: no compute
/// limit). Also advertised as node capacity: 100 per GPU.
pub const CORES: [&str; 2] = ["nvidia.com/gpucores", "nvidia.com/vgpu-cores"];
const USE_UUID: [&str; 2] = ["nvidia.com/use-gpuuuid", "nvidia.com/include-gpu-uuid"];
const NOUSE_UUID: [&str; 2] = ["nvidia.com/nouse-gpuuuid", "nvidia.com/exclude-gpu-uuid"];
const USE_TYPE: [&str; 2] = ["nvidia.com/use-gputype", "nvidia.com/include-gpu-type"];
const NOUSE_TYPE: [&str; 2] = ["nvidia.com/nouse-gputype", "nvidia.com/exclude-gpu-type"];
const GPU_POLICY: [&str; 2] = [
    "hami.io/gpu-scheduler-policy",
    "nvidia.com/device-scheduler-policy",
];
const COMPUTE_POLICY: &str = "nvidia.com/vgpu-compute-policy";
const CLASS: &str = "gpushare.dev/class";
const OVERSUBSCRIBE: &str = "gpushare.dev/oversubscribe";
const SPILL_LIMIT: &str = "gpushare.dev/spill-limit";
const CORUN: &str = "gpushare.dev/corun";

/// Why a pod's ask cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AskError {
    /// A limit or annotation that must be a number or a Kubernetes
    /// quantity is neither.
    #[error("{name}: {value:?} is not a whole number")]
    Quantity {
        /// The resource name or annotation.
        name: String,
        /// Its text, as the pod has it.
        value: String,
    },
    /// A limit outside what it can mean (more than 64 GPUs, a percent
    /// above 100).
    #[error("{name}: {value} is not within {min}..={max}")]
    Range {
        /// The resource name.
        name: String,
        /// The limit, rounded up to a whole number.
        value: u64,
        /// The least it may be.
        min: u64,
        /// The most it may be.
        max: u64,
    },
    /// An annotation whose word is not one it takes.
    #[error("{name}: {value:?} is not one of {allowed}")]
    Word {
        /// The annotation.
        name: &'static str,
        /// Its text (the compute policy's lowercased).
        value: String,
        /// The words it takes, comma-separated.
        allowed: &'static str,
    },
}

/// Memory per GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryAsk {
    /// MiB on each GPU (`nvidia.com/gpumem`, `nvidia.com/vgpu-memory`).
    Mib(u64),
    /// Percent of each GPU's memory, 1..=100 (`nvidia.com/gpumem-percentage`).
    Percent(u8),
    /// The whole GPU (no memory limit named).
    Whole,
}

/// How GPUs are picked among those that fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Packing {
    /// The most used GPU first: fewer GPUs fragmented.
    Binpack,
    /// The least used GPU first.
    Spread,
}

/// One container's ask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerAsk {
    /// The container's name in its pod.
    pub container: String,
    /// GPUs asked: the plugin resource's limit, 1..=64; also the number of
    /// shares the kubelet allocates for it.
    pub count: u32,
    /// Memory on each of those GPUs.
    pub memory: MemoryAsk,
    /// Percent of each GPU; `None`: no compute limit.
    pub cores: Option<u8>,
}

/// The pod's annotations that steer placement and sharing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodPrefs {
    /// The only GPUs the pod may get, by UUID (any case); empty: any GPU.
    pub use_uuids: Vec<String>,
    /// GPUs the pod must not get, by UUID.
    pub nouse_uuids: Vec<String>,
    /// Parts of a GPU's product name, any case: when given, only GPUs
    /// whose name contains one.
    pub use_types: Vec<String>,
    /// Parts of a GPU's product name that exclude a GPU whose name
    /// contains one.
    pub nouse_types: Vec<String>,
    /// Which of the GPUs that fit are taken first; default binpack.
    pub packing: Packing,
    /// The compute policy of the pod's claims (`balance` is elastic);
    /// default fixed. Containers without a compute limit get `none`.
    pub policy: Policy,
    /// Latency pods are served first on their GPUs; default batch.
    pub class: PodClass,
    /// Host memory the pod may spill to past its quota per GPU; 0 = none.
    pub spill_bytes: u64,
    /// Only co-run GPUs (`Some(true)`), none (`Some(false)`), or either.
    pub corun: Option<bool>,
}

/// The ask of `container` for `resource` (the count), or `None` when it asks
/// for none of it.
pub fn container_ask(
    container: &Container,
    resource: &str,
) -> Result<Option<ContainerAsk>, AskError> {
    let empty = BTreeMap::new();
    let limits = container
        .resources
        .as_ref()
        .and_then(|r| r.limits.as_ref().or(r.requests.as_ref()))
        .unwrap_or(&empty);
    let number = |name: &str| -> Result<Option<u64>, AskError> {
        let Some(q) = limits.get(name) else {
            return Ok(None);
        };
        quantity::parse(&q.0)
            .map(Some)
            .ok_or_else(|| AskError::Quantity {
                name: name.to_owned(),
                value: q.0.clone(),
            })
    };
    let ranged = |name: &str, min: u64, max: u64| -> Result<Option<u64>, AskError> {
        match number(name)? {
            Some(value) if !(min..=max).contains(&value) => Err(AskError::Range {
                name: name.to_owned(),
                value,
                min,
                max,
            }),
            other => Ok(other),
        }
    };
    let Some(count) = ranged(resource, 0, 64)?.filter(|c| *c > 0) else {
        return Ok(None);
    };
    let mut memory = MemoryAsk::Whole;
    if let Some(p) = ranged(MEMORY_PERCENT, 1, 100)? {
        memory = MemoryAsk::Percent(p as u8);
    }
    for name in MEMORY_MIB {
        if let Some(mib) = ranged(name, 0, u64::MAX >> 20)?.filter(|m| *m > 0) {
            memory = MemoryAsk::Mib(mib);
        }
    }
    let mut cores = None;
    for name in CORES {
        if let Some(c) = ranged(name, 0, 100)? {
            cores = (c > 0).then_some(c as u8);
        }
    }
    Ok(Some(ContainerAsk {
        container: container.name.clone(),
        count: count as u32,
        memory,
        cores,
    }))
}

/// The pod's placement and sharing annotations.
pub fn pod_prefs(pod: &Pod) -> Result<PodPrefs, AskError> {
    let empty = BTreeMap::new();
    let annotations = pod.metadata.annotations.as_ref().unwrap_or(&empty);
    let first = |names: &[&'static str]| -> Option<(&'static str, &str)> {
        names
            .iter()
            .find_map(|n| annotations.get(*n).map(|v| (*n, v.trim())))
            .filter(|(_, v)| !v.is_empty())
    };
    let list = |names: &[&'static str]| -> Vec<String> {
        names
            .iter()
            .filter_map(|n| annotations.get(*n))
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect()
    };
    let packing = match first(&GPU_POLICY) {
        None => Packing::Binpack,
        Some((_, v)) if v.eq_ignore_ascii_case("binpack") => Packing::Binpack,
        Some((_, v)) if v.eq_ignore_ascii_case("spread") => Packing::Spread,
        Some((name, v)) => {
            return Err(AskError::Word {
                name,
                value: v.to_owned(),
                allowed: "binpack, spread",
            });
        }
    };
    let policy = match first(&[COMPUTE_POLICY]).map(|(_, v)| v.to_ascii_lowercase()) {
        None => Policy::Fixed,
        Some(v) if v == "fixed" => Policy::Fixed,
        Some(v) if v == "balance" => Policy::Elastic,
        Some(v) if v == "none" => Policy::None,
        Some(v) => {
            return Err(AskError::Word {
                name: COMPUTE_POLICY,
                value: v,
                allowed: "fixed, balance, none",
            });
        }
    };
    let class = match first(&[CLASS]) {
        None => PodClass::Batch,
        Some((name, v)) => PodClass::parse(v).ok_or_else(|| AskError::Word {
            name,
            value: v.to_owned(),
            allowed: "batch, latency",
        })?,
    };
    let switch = |name: &'static str| {
        first(&[name])
            .map(|(name, v)| {
                parse_switch(v).ok_or_else(|| AskError::Word {
                    name,
                    value: v.to_owned(),
                    allowed: "true, false",
                })
            })
            .transpose()
    };
    let oversubscribe = switch(OVERSUBSCRIBE)?;
    let corun = switch(CORUN)?;
    let spill_limit = first(&[SPILL_LIMIT])
        .map(|(name, v)| {
            quantity::parse(v).ok_or_else(|| AskError::Quantity {
                name: name.to_owned(),
                value: v.to_owned(),
            })
        })
        .transpose()?;
    Ok(PodPrefs {
        use_uuids: list(&USE_UUID),
        nouse_uuids: list(&NOUSE_UUID),
        use_types: list(&USE_TYPE),
        nouse_types: list(&NOUSE_TYPE),
        packing,
        policy,
        class,
        spill_bytes: spec::spill_cap(oversubscribe, spill_limit),
        corun,
    })
}

impl PodPrefs {
    /// Whether the annotations allow GPU `uuid` named `name`.
    pub fn allows(&self, uuid: &str, name: &str) -> bool {
        let name = name.to_ascii_lowercase();
        let typed = |t: &String| name.contains(&t.to_ascii_lowercase());
        let same = |u: &String| u.eq_ignore_ascii_case(uuid);
        (self.use_uuids.is_empty() || self.use_uuids.iter().any(same))
            && !self.nouse_uuids.iter().any(same)
            && (self.use_types.is_empty() || self.use_types.iter().any(typed))
            && !self.nouse_types.iter().any(typed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn container(limits: serde_json::Value) -> Container {
        serde_json::from_value(json!({"name": "main", "resources": {"limits": limits}})).unwrap()
    }

    #[test]
    fn resource_names_and_units() {
        let gpu = "nvidia.com/gpu";
        let cases = [
            (
                json!({"nvidia.com/gpu": "1", "nvidia.com/gpumem": "4096", "nvidia.com/gpucores": "30"}),
                Some((1, MemoryAsk::Mib(4096), Some(30))),
            ),
            (
                json!({"nvidia.com/gpu": "2", "nvidia.com/gpumem-percentage": "50"}),
                Some((2, MemoryAsk::Percent(50), None)),
            ),
            (
                json!({"nvidia.com/gpu": "1"}),
                Some((1, MemoryAsk::Whole, None)),
            ),
            (
                json!({"nvidia.com/gpu": "1", "nvidia.com/vgpu-memory": "1024", "nvidia.com/vgpu-cores": "10"}),
                Some((1, MemoryAsk::Mib(1024), Some(10))),
            ),
            (json!({"nvidia.com/gpumem": "1024"}), None),
            (json!({"nvidia.com/gpu": "0"}), None),
        ];
        for (limits, want) in cases {
            let got = container_ask(&container(limits.clone()), gpu).unwrap();
            assert_eq!(got.map(|a| (a.count, a.memory, a.cores)), want, "{limits}");
        }
        let over = container(json!({"nvidia.com/gpu": "1", "nvidia.com/gpucores": "150"}));
        assert!(matches!(
            container_ask(&over, gpu),
            Err(AskError::Range { value: 150, .. })
        ));
        let vgpu = container(json!({"nvidia.com/vgpu-number": "1"}));
        assert_eq!(
            container_ask(&vgpu, "nvidia.com/vgpu-number")
                .unwrap()
                .map(|a| a.count),
            Some(1)
        );
    }

    #[test]
    fn annotations() {
        let pod: Pod = serde_json::from_value(json!({"metadata": {"annotations": {
            "nvidia.com/use-gpuuuid": "GPU-a, GPU-b",
            "nvidia.com/exclude-gpu-uuid": "GPU-b",
            "nvidia.com/nouse-gputype": "A100",
            "hami.io/gpu-scheduler-policy": "spread",
            "nvidia.com/vgpu-compute-policy": "balance",
            "gpushare.dev/class": "Latency",
        }}}))
        .unwrap();
        let prefs = pod_prefs(&pod).unwrap();
        assert_eq!(prefs.class, PodClass::Latency);
        assert_eq!(prefs.spill_bytes, 0);
        assert_eq!(prefs.packing, Packing::Spread);
        assert_eq!(prefs.policy, Policy::Elastic);
        assert!(prefs.allows("GPU-a", "NVIDIA H100 80GB HBM3"));
        assert!(!prefs.allows("GPU-b", "NVIDIA H100 80GB HBM3"));
        assert!(!prefs.allows("GPU-c", "NVIDIA H100 80GB HBM3"));
        assert!(!prefs.allows("GPU-a", "NVIDIA A100-SXM4-80GB"));
        let bad: Pod = serde_json::from_value(
            json!({"metadata": {"annotations": {"hami.io/gpu-scheduler-policy": "random"}}}),
        )
        .unwrap();
        assert!(pod_prefs(&bad).is_err());
        assert!(prefs_with(json!({"gpushare.dev/class": "urgent"})).is_err());
        let plain = pod_prefs(&Pod::default()).unwrap();
        assert_eq!(plain.class, PodClass::Batch);
        assert_eq!(
            (plain.packing, plain.policy),
            (Packing::Binpack, Policy::Fixed)
        );
    }

    /// The prefs of a pod with `annotations`.
    fn prefs_with(annotations: serde_json::Value) -> Result<PodPrefs, AskError> {
        let pod: Pod =
            serde_json::from_value(json!({"metadata": {"annotations": annotations}})).unwrap();
        pod_prefs(&pod)
    }

    #[test]
    fn oversubscription_annotations() {
        let spill =
            |annotations: serde_json::Value| prefs_with(annotations).map(|prefs| prefs.spill_bytes);
        assert_eq!(
            spill(json!({"gpushare.dev/spill-limit": "16Gi"})),
            Ok(16 << 30)
        );
        assert_eq!(
            spill(json!({"gpushare.dev/oversubscribe": "True"})),
            Ok(gpushare_utils::limits::default_spill_limit())
        );
        assert_eq!(
            spill(
                json!({"gpushare.dev/oversubscribe": "false", "gpushare.dev/spill-limit": "1Gi"})
            ),
            Ok(0)
        );
        assert!(spill(json!({"gpushare.dev/oversubscribe": "maybe"})).is_err());
        assert!(spill(json!({"gpushare.dev/spill-limit": "lots"})).is_err());
    }

    #[test]
    fn the_corun_annotation_picks_the_kind_of_gpu() {
        let corun =
            |annotations: serde_json::Value| prefs_with(annotations).map(|prefs| prefs.corun);
        assert_eq!(corun(json!({})), Ok(None));
        assert_eq!(corun(json!({"gpushare.dev/corun": "true"})), Ok(Some(true)));
        assert_eq!(
            corun(json!({"gpushare.dev/corun": "False"})),
            Ok(Some(false))
        );
        assert!(corun(json!({"gpushare.dev/corun": "sometimes"})).is_err());
    }
}
