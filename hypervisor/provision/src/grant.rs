//! What a claim was given: the pod it is for and, per GPU, the memory and
//! compute it may use and how its share behaves. Source-neutral: the DRA
//! plugin builds these from a ResourceClaim's allocation, the device plugin
//! from a pod's resource names.

use serde::{Deserialize, Serialize};

use super::ProvisionError;
use gpushare_utils::pod::{PodClass, is_uid};

use hypervisor_core::spec::Policy;

/// The pod a claim is for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    /// The pod's UID; for a claim several pods share, the claim's UID (the
    /// quota identity, the DRA claims' `quota_identity`). Names the
    /// hypervisor's pod, its token and its region.
    pub uid: String,
    /// The pod's namespace (the claim's).
    pub namespace: String,
    /// The pod's name; `resourceclaim/<claim name>` for a shared claim.
    pub name: String,
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{} ({})", self.namespace, self.name, self.uid)
    }
}

/// How a claim's compute share behaves (the opaque device configuration).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SharingParams {
    /// Weight among the pods that want the GPU (default 1).
    pub weight: u32,
    /// `fixed` (never above the share), `elastic` (up to `ceiling` while
    /// others leave the GPU idle) or `none` (unlimited). Default: fixed.
    #[serde(with = "policy_text")]
    pub policy: Policy,
    /// Elastic pods' ceiling in percent (default 100).
    pub ceiling: Option<u8>,
    /// Scheduling priority, higher first (default 0). Recorded and shown;
    /// the hypervisor's scheduler orders by weight only so far.
    pub priority: i32,
    /// `latency` or `batch` (default): see [`PodClass`].
    #[serde(default, with = "class_text")]
    pub class: PodClass,
    /// Oversubscription: host memory the pod may spill to past its quota on
    /// the GPU, in bytes; 0 (default) = none.
    #[serde(default)]
    pub spill_bytes: u64,
}

impl Default for SharingParams {
    fn default() -> Self {
        Self {
            weight: 1,
            policy: Policy::Fixed,
            ceiling: None,
            priority: 0,
            class: PodClass::Batch,
            spill_bytes: 0,
        }
    }
}

/// One GPU (a device of the node's ResourceSlice) given to a claim.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGrant {
    /// The claim's requests this device serves.
    pub requests: Vec<String>,
    /// The device's pool in the ResourceSlice: the node's name.
    pub pool: String,
    /// The device's name in the slice, `gpu-<index>`.
    pub device: String,
    /// The GPU's NVML UUID: what the hypervisor's limits and
    /// `CUDA_VISIBLE_DEVICES` name.
    pub gpu_uuid: String,
    /// The GPU's NVML index, which orders a pod's GPUs.
    pub gpu_index: u32,
    /// Memory quota in bytes (consumed capacity `memory`).
    pub memory_bytes: u64,
    /// Compute share in percent, 1..=100 (consumed capacity `compute`); 0
    /// with policy `none` (a device plugin pod without a compute limit).
    pub compute_percent: u8,
    /// How the share behaves: the claim's opaque parameters, or for the
    /// device plugin the pod's annotations.
    pub params: SharingParams,
}

/// A claim to prepare.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRequest {
    /// The ResourceClaim's UID; for the device plugin, a random one
    /// ([`super::new_uid`]). Keys the checkpoint and names the CDI device.
    pub claim_uid: String,
    /// The claim's namespace (its pod's).
    pub namespace: String,
    /// The ResourceClaim's name; for the device plugin, the container's.
    pub name: String,
    /// Whose quota the claim is: its pod, or the claim itself when several
    /// pods share it.
    pub pod: PodRef,
    /// One per allocated device of this driver on this node; never empty
    /// once [`Self::validate`] passes.
    pub devices: Vec<DeviceGrant>,
}

impl ClaimRequest {
    /// Refuses what cannot become limits: no device, no memory, a share of 0
    /// or above 100, a ceiling below the share, a UID that is no pod id.
    pub fn validate(&self) -> Result<(), ProvisionError> {
        let invalid = |message: String| ProvisionError::Invalid {
            claim: self.claim_uid.clone(),
            message,
        };
        if self.devices.is_empty() {
            return Err(invalid("no device of this driver is allocated".into()));
        }
        if !is_uid(&self.pod.uid) {
            return Err(invalid(format!("pod UID {:?} is not a UID", self.pod.uid)));
        }
        if !is_uid(&self.claim_uid) {
            return Err(invalid(format!(
                "claim UID {:?} is not a UID",
                self.claim_uid
            )));
        }
        for d in &self.devices {
            if d.memory_bytes == 0 {
                return Err(invalid(format!("{}: no memory", d.device)));
            }
            // 0: no compute limit, only with the policy that says so.
            let unlimited = d.compute_percent == 0 && d.params.policy == Policy::None;
            if !unlimited && !(1..=100).contains(&d.compute_percent) {
                return Err(invalid(format!(
                    "{}: compute {} is not 1..100",
                    d.device, d.compute_percent
                )));
            }
            if d.params.weight == 0 {
                return Err(invalid(format!("{}: weight 0", d.device)));
            }
            if let Some(ceiling) = d.params.ceiling
                && !(d.compute_percent..=100).contains(&ceiling)
            {
                return Err(invalid(format!(
                    "{}: ceiling {ceiling} is not between compute {} and 100",
                    d.device, d.compute_percent
                )));
            }
        }
        Ok(())
    }
}

/// `Policy` as its config word (`fixed`, `elastic`, `none`).
mod policy_text {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    use hypervisor_core::spec::Policy;

    pub(super) fn serialize<S: Serializer>(policy: &Policy, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(policy.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Policy, D::Error> {
        let text = String::deserialize(d)?;
        Policy::parse(&text).ok_or_else(|| {
            D::Error::custom(format!("policy {text:?} is not fixed, elastic or none"))
        })
    }
}

mod class_text {
    use gpushare_utils::pod::PodClass;
    use serde::{Deserialize, Deserializer, Serializer, de::Error};

    pub(super) fn serialize<S: Serializer>(class: &PodClass, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(class.as_str())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<PodClass, D::Error> {
        let text = String::deserialize(d)?;
        PodClass::parse(&text)
            .ok_or_else(|| D::Error::custom(format!("class {text:?} is not latency or batch")))
    }
}

/// Several claims of one pod on one GPU, added up.
#[derive(Debug, Default)]
pub(crate) struct Totals {
    pub memory_bytes: u64,
    pub compute_percent: u32,
    pub weight: u32,
    /// The most permissive policy of the claims, and the highest ceiling.
    policy: Option<Policy>,
    ceiling: Option<u8>,
    /// Latency when any claim is.
    pub class: PodClass,
    /// The claims' spill caps, added up like their memory.
    pub spill_bytes: u64,
}

impl Totals {
    pub(super) fn add(&mut self, d: &DeviceGrant) {
        self.memory_bytes = self.memory_bytes.saturating_add(d.memory_bytes);
        self.compute_percent += u32::from(d.compute_percent);
        self.weight = self.weight.max(d.params.weight);
        self.policy = Some(match (self.policy, d.params.policy) {
            (Some(Policy::None), _) | (_, Policy::None) => Policy::None,
            (Some(Policy::Elastic), _) | (_, Policy::Elastic) => Policy::Elastic,
            _ => Policy::Fixed,
        });
        self.ceiling = self.ceiling.max(d.params.ceiling);
        if d.params.class == PodClass::Latency {
            self.class = PodClass::Latency;
        }
        self.spill_bytes = self.spill_bytes.saturating_add(d.params.spill_bytes);
    }

    /// Cap, guaranteed share and policy for the hypervisor: a fixed share is
    /// a hard cap; an elastic one is guaranteed and may grow to the ceiling.
    pub(super) fn compute(&self) -> (Option<u8>, Option<u8>, Policy) {
        let share = self.compute_percent.min(100) as u8;
        match self.policy.unwrap_or(Policy::Fixed) {
            Policy::Fixed => (Some(share.max(1)), None, Policy::Fixed),
            Policy::Elastic => {
                let ceiling = self.ceiling.unwrap_or(100).max(share);
                (Some(ceiling.max(1)), Some(share), Policy::Elastic)
            }
            Policy::None => (None, None, Policy::None),
        }
    }

    /// [`Totals::compute`] on a co-run GPU: a fixed share is the client's
    /// share of the SMs there ([`Totals::sm_share`]), not of the time, so it
    /// leaves no time cap; an elastic share (weights) stays a time share.
    pub(super) fn compute_on_corun(&self) -> (Option<u8>, Option<u8>, Policy) {
        match self.policy.unwrap_or(Policy::Fixed) {
            Policy::Fixed => (None, None, Policy::None),
            Policy::Elastic | Policy::None => self.compute(),
        }
    }

    /// The percent of the SMs a fixed share becomes on a co-run GPU; `None`
    /// for an elastic share or none.
    pub(super) fn sm_share(&self) -> Option<u8> {
        (self.policy.unwrap_or(Policy::Fixed) == Policy::Fixed)
            .then(|| (self.compute_percent.min(100) as u8).max(1))
    }
}

#[cfg(test)]
impl DeviceGrant {
    /// The tests' grant: 1 GiB and `compute_percent` of GPU 0 (`GPU-0`,
    /// device `gpu-0` of pool `node`) for request `gpu`.
    pub(crate) fn example(compute_percent: u8, params: SharingParams) -> Self {
        Self {
            requests: vec!["gpu".into()],
            pool: "node".into(),
            device: "gpu-0".into(),
            gpu_uuid: "GPU-0".into(),
            gpu_index: 0,
            memory_bytes: 1 << 30,
            compute_percent,
            params,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(compute: u8, policy: Policy, ceiling: Option<u8>) -> DeviceGrant {
        let params = SharingParams {
            policy,
            ceiling,
            ..SharingParams::default()
        };
        DeviceGrant::example(compute, params)
    }

    #[test]
    fn compute_becomes_cap_or_share() {
        let cases = [
            (
                vec![grant(30, Policy::Fixed, None)],
                (Some(30), None, Policy::Fixed),
            ),
            (
                vec![grant(30, Policy::Elastic, Some(80))],
                (Some(80), Some(30), Policy::Elastic),
            ),
            (
                vec![grant(30, Policy::Elastic, None)],
                (Some(100), Some(30), Policy::Elastic),
            ),
            (
                vec![
                    grant(30, Policy::Fixed, None),
                    grant(20, Policy::Fixed, None),
                ],
                (Some(50), None, Policy::Fixed),
            ),
            (
                vec![grant(30, Policy::None, None)],
                (None, None, Policy::None),
            ),
        ];
        for (grants, want) in cases {
            let mut totals = Totals::default();
            grants.iter().for_each(|g| totals.add(g));
            assert_eq!(totals.compute(), want, "{grants:?}");
        }
    }

    #[test]
    fn on_a_corun_gpu_a_fixed_share_is_of_the_sms() {
        let totals = |grants: &[DeviceGrant]| {
            let mut totals = Totals::default();
            grants.iter().for_each(|g| totals.add(g));
            totals
        };
        let fixed = totals(&[
            grant(30, Policy::Fixed, None),
            grant(20, Policy::Fixed, None),
        ]);
        assert_eq!(fixed.sm_share(), Some(50));
        assert_eq!(fixed.compute_on_corun(), (None, None, Policy::None));
        let elastic = totals(&[grant(30, Policy::Elastic, Some(80))]);
        assert_eq!(elastic.sm_share(), None);
        assert_eq!(elastic.compute_on_corun(), elastic.compute());
        let none = totals(&[grant(0, Policy::None, None)]);
        assert_eq!(none.sm_share(), None);
        assert_eq!(none.compute_on_corun(), (None, None, Policy::None));
    }

    #[test]
    fn spill_caps_add_up_and_old_checkpoints_have_none() {
        let mut totals = Totals::default();
        for spill_bytes in [1 << 30, 2 << 30] {
            let mut g = grant(30, Policy::Fixed, None);
            g.params.spill_bytes = spill_bytes;
            totals.add(&g);
        }
        assert_eq!(totals.spill_bytes, 3 << 30);
        let old: SharingParams =
            serde_json::from_str(r#"{"weight":1,"policy":"fixed","ceiling":null,"priority":0}"#)
                .expect("params without spill");
        assert_eq!(old.spill_bytes, 0);
    }
}
