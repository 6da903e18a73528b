//! What the scheduler is told: one [`PodSpec`] per pod, whatever the source
//! (the config file today; a Kubernetes pod watcher can build the same list
//! and hand it to [`Scheduler::apply`](crate::scheduler::Scheduler::apply)).

use std::fmt;
use std::sync::Arc;

use gpushare_utils::limits::default_spill_limit;
use gpushare_utils::pod::{PodClass, PodId};
use gpushare_utils::quote::quoted;
use serde::Serialize;
use subtle::ConstantTimeEq;

/// Longest accepted token, in bytes.
pub const MAX_TOKEN_LEN: usize = 4096;

/// Why a spec is refused. Every message names the field, and shows at most
/// 200 characters of a value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// The pod id is not 1 to 64 bytes of ASCII letters, digits, `_`, `.`
    /// and `-` (it names the pod's region file).
    #[error("{0}")]
    PodId(#[from] gpushare_utils::pod::InvalidPodId),
    /// The token is empty (the config trims tokens first, so one of only
    /// whitespace is too).
    #[error("token is empty")]
    EmptyToken,
    /// The token is longer than [`MAX_TOKEN_LEN`] bytes.
    #[error("token is longer than {MAX_TOKEN_LEN} bytes")]
    LongToken,
    /// The token holds whitespace or control characters, which cannot
    /// travel in an `Authorization` header.
    #[error("token holds whitespace or control characters")]
    BadToken,
    /// `weight = 0`; weights start at 1.
    #[error("weight must be at least 1")]
    ZeroWeight,
    /// `cap` outside 1..=100; the value given.
    #[error("cap must be a percent from 1 to 100, not {0}")]
    BadCap(u8),
    /// `share` above 100; the value given.
    #[error("share must be a percent from 0 to 100, not {0}")]
    BadShare(u8),
    /// A guaranteed share the pod's own cap would never let it reach.
    #[error("share {share}% is above cap {cap}%")]
    ShareAboveCap {
        /// The `share` given, in percent.
        share: u8,
        /// The `cap` given, in percent.
        cap: u8,
    },
    /// A `uuid` without the `GPU-`/`MIG-` prefix, longer than 96 bytes or
    /// with characters no NVML UUID has; the value given.
    #[error("GPU uuid {} is not a GPU-… or MIG-… UUID", quoted(.0))]
    BadUuid(String),
    /// An `index` at or past [`MAX_DEVICES`](gpushare_utils::ledger::MAX_DEVICES),
    /// the devices a pod's region has room for.
    #[error("GPU index {0} is beyond the 16 devices a region holds")]
    BadIndex(u32),
    /// One pod names the same GPU twice (by the same UUID, in any case, or
    /// the same index); the GPU as named.
    #[error("GPU {0} is listed twice for one pod")]
    DuplicateGpu(String),
    /// Two pods of one list have the same id.
    #[error("pod {0} is listed twice")]
    DuplicatePod(String),
}

/// A bearer token. Compared in constant time (for equal lengths; the length
/// itself is not secret-kept); never printed.
#[derive(Clone)]
pub struct Token(Arc<str>);

impl Token {
    /// Validates `token`: 1 to 4096 bytes, no whitespace or control characters
    /// (it travels in an `Authorization` header).
    pub fn new(token: &str) -> Result<Self, SpecError> {
        if token.is_empty() {
            return Err(SpecError::EmptyToken);
        }
        if token.len() > MAX_TOKEN_LEN {
            return Err(SpecError::LongToken);
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(SpecError::BadToken);
        }
        Ok(Self(token.into()))
    }

    /// Whether `presented` is this token, in time independent of where they differ.
    pub fn matches(&self, presented: &str) -> bool {
        bool::from(self.0.as_bytes().ct_eq(presented.as_bytes()))
    }

    /// The token itself, for clients (tests, the status command).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl PartialEq for Token {
    fn eq(&self, other: &Self) -> bool {
        self.matches(&other.0)
    }
}

impl Eq for Token {}

impl fmt::Debug for Token {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Token(***)")
    }
}

/// How a pod's compute share treats time other pods leave idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Never above its cap (or its share when no cap is set).
    Fixed,
    /// At least its share when contended; idle time up to its cap (100% when
    /// no cap is set) while the others are idle.
    Elastic,
    /// Not metered: the bucket is unlimited.
    None,
}

impl Policy {
    /// `fixed`, `elastic` or `none`, case-insensitive.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fixed" => Some(Self::Fixed),
            "elastic" => Some(Self::Elastic),
            "none" => Some(Self::None),
            _ => None,
        }
    }

    /// The name [`Policy::parse`] reads and the status shows: `fixed`,
    /// `elastic` or `none`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Elastic => "elastic",
            Self::None => "none",
        }
    }

    /// The default: fixed when a cap is set, elastic when only a share is,
    /// none otherwise.
    pub fn default_for(cap: Option<u8>, share: Option<u8>) -> Self {
        match (cap, share) {
            (Some(_), _) => Self::Fixed,
            (None, Some(_)) => Self::Elastic,
            (None, None) => Self::None,
        }
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GpuSelector {
    /// By `GPU-…`/`MIG-…` UUID (kept as given; matched case-insensitively).
    Uuid(String),
    /// By the observer's (NVML's) index.
    Index(u32),
}

impl GpuSelector {
    /// A UUID selector, validated.
    pub fn uuid(uuid: &str) -> Result<Self, SpecError> {
        let t = uuid.trim();
        let prefixed = ["GPU-", "MIG-"]
            .iter()
            .any(|p| t.len() > p.len() && t[..p.len()].eq_ignore_ascii_case(p));
        let clean = t
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'/' | b'.'));
        if !prefixed || !clean || t.len() > 96 {
            return Err(SpecError::BadUuid(uuid.to_owned()));
        }
        Ok(Self::Uuid(t.to_owned()))
    }

    /// An index selector, validated.
    pub fn index(index: u32) -> Result<Self, SpecError> {
        if index as usize >= gpushare_utils::ledger::MAX_DEVICES {
            return Err(SpecError::BadIndex(index));
        }
        Ok(Self::Index(index))
    }

    /// Whether this names the observed GPU `gpu`.
    pub fn selects(&self, gpu: &hypervisor_observer::GpuInfo) -> bool {
        match self {
            Self::Index(i) => gpu.index == *i,
            Self::Uuid(u) => gpu.uuid.eq_ignore_ascii_case(u),
        }
    }

    /// A GPU as an operator names it: its NVML index (digits), or its UUID.
    pub fn parse(text: &str) -> Result<Self, SpecError> {
        let t = text.trim();
        match t.parse::<u32>() {
            Ok(index) if t.bytes().all(|b| b.is_ascii_digit()) => Self::index(index),
            _ => Self::uuid(t),
        }
    }

    fn key(&self) -> String {
        match self {
            Self::Uuid(u) => u.to_ascii_lowercase(),
            Self::Index(i) => format!("index {i}"),
        }
    }
}

impl fmt::Display for GpuSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Uuid(u) => f.write_str(u),
            Self::Index(i) => write!(f, "index {i}"),
        }
    }
}

/// One pod's limits on one GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuSpec {
    /// The GPU, as the source named it; an index is resolved to a UUID
    /// against the observer's GPUs when the spec is applied.
    pub gpu: GpuSelector,
    /// Memory quota in bytes; 0 = unlimited.
    pub memory_bytes: u64,
    /// Weight among the pods that want the GPU, at least 1.
    pub weight: u32,
    /// Hard cap in percent, 1..=100.
    pub cap_percent: Option<u8>,
    /// Guaranteed share in percent, 0..=cap.
    pub share_percent: Option<u8>,
    /// How the share treats idle time; [`Policy::default_for`] the cap and
    /// share when the source gave none.
    pub policy: Policy,
    /// Latency pods are served first on the GPU; batch (the default) pods
    /// wait while one is active.
    pub class: PodClass,
    /// Oversubscription: bytes of host memory the pod may spill to past its
    /// quota on the GPU, pod-wide; 0 = none (see [`spill_cap`]).
    pub spill_bytes: u64,
    /// On a co-run GPU: the pod's fixed share of the SMs, in percent; its
    /// MPS clients never take more.
    pub sm_share: Option<u8>,
}

/// The spill cap a pod's GPU setting asks for: `limit` when given (0 =
/// none), else with `oversubscribe` on the default (a quarter of the node's
/// memory, [`default_spill_limit`]); `oversubscribe = false` turns it off
/// whatever the limit.
pub fn spill_cap(oversubscribe: Option<bool>, limit: Option<u64>) -> u64 {
    match (oversubscribe, limit) {
        (Some(false), _) | (None, None) => 0,
        (_, Some(bytes)) => bytes,
        (Some(true), None) => default_spill_limit(),
    }
}

impl GpuSpec {
    /// The same spec with `class`.
    pub fn with_class(self, class: PodClass) -> Self {
        Self { class, ..self }
    }

    /// The same spec with a spill cap of `spill_bytes` (0 = none).
    pub fn with_spill(self, spill_bytes: u64) -> Self {
        Self {
            spill_bytes,
            ..self
        }
    }

    /// The same spec with a fixed share of a co-run GPU's SMs.
    pub fn with_sm_share(self, sm_share: Option<u8>) -> Self {
        Self { sm_share, ..self }
    }

    /// A validated spec; `policy` `None` takes [`Policy::default_for`].
    pub fn new(
        gpu: GpuSelector,
        memory_bytes: u64,
        weight: u32,
        cap_percent: Option<u8>,
        share_percent: Option<u8>,
        policy: Option<Policy>,
    ) -> Result<Self, SpecError> {
        if weight == 0 {
            return Err(SpecError::ZeroWeight);
        }
        if let Some(cap) = cap_percent
            && !(1..=100).contains(&cap)
        {
            return Err(SpecError::BadCap(cap));
        }
        if let Some(share) = share_percent {
            if share > 100 {
                return Err(SpecError::BadShare(share));
            }
            if let Some(cap) = cap_percent
                && share > cap
            {
                return Err(SpecError::ShareAboveCap { share, cap });
            }
        }
        Ok(Self {
            gpu,
            memory_bytes,
            weight,
            cap_percent,
            share_percent,
            policy: policy.unwrap_or_else(|| Policy::default_for(cap_percent, share_percent)),
            class: PodClass::Batch,
            spill_bytes: 0,
            sm_share: None,
        })
    }

    /// The most this pod may take of the GPU, in percent, when metered.
    pub fn bound_percent(&self) -> u8 {
        match self.policy {
            Policy::Fixed => self.cap_percent.or(self.share_percent).unwrap_or(100),
            Policy::Elastic | Policy::None => self.cap_percent.unwrap_or(100),
        }
    }

    /// What it is guaranteed when contended, in percent (never above the bound).
    pub fn floor_percent(&self) -> u8 {
        self.share_percent.unwrap_or(0).min(self.bound_percent())
    }
}

/// Everything the hypervisor knows about one pod.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodSpec {
    /// The pod's id: its region's name and the key of every API call.
    pub id: PodId,
    /// The bearer token its workers present; unique per pod (a shared one
    /// lets each act as the other).
    pub token: Token,
    /// Its limits, one per GPU it may use, no GPU twice; empty: the pod is
    /// known but given no GPU.
    pub gpus: Vec<GpuSpec>,
}

impl PodSpec {
    /// A validated spec: no GPU twice.
    pub fn new(id: PodId, token: Token, gpus: Vec<GpuSpec>) -> Result<Self, SpecError> {
        check_gpus(&gpus)?;
        Ok(Self { id, token, gpus })
    }
}

/// Refuses a GPU list naming one GPU twice (by the same selector).
pub fn check_gpus(gpus: &[GpuSpec]) -> Result<(), SpecError> {
    let mut seen = std::collections::HashSet::new();
    for gpu in gpus {
        if !seen.insert(gpu.gpu.key()) {
            return Err(SpecError::DuplicateGpu(gpu.gpu.to_string()));
        }
    }
    Ok(())
}

/// Refuses a pod list naming one pod twice.
pub fn check_pods(pods: &[PodSpec]) -> Result<(), SpecError> {
    let mut seen = std::collections::HashSet::new();
    for pod in pods {
        if !seen.insert(pod.id.as_str()) {
            return Err(SpecError::DuplicatePod(pod.id.to_string()));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(
        cap: Option<u8>,
        share: Option<u8>,
        policy: Option<Policy>,
    ) -> Result<GpuSpec, SpecError> {
        GpuSpec::new(GpuSelector::Index(0), 0, 1, cap, share, policy)
    }

    #[test]
    fn policy_defaults_and_bounds() {
        let fixed = gpu(Some(30), None, None).unwrap();
        assert_eq!(
            (fixed.policy, fixed.bound_percent(), fixed.floor_percent()),
            (Policy::Fixed, 30, 0)
        );
        let elastic = gpu(None, Some(25), None).unwrap();
        assert_eq!(
            (
                elastic.policy,
                elastic.bound_percent(),
                elastic.floor_percent()
            ),
            (Policy::Elastic, 100, 25)
        );
        let none = gpu(None, None, None).unwrap();
        assert_eq!(none.policy, Policy::None);
        let fixed_share = gpu(None, Some(40), Some(Policy::Fixed)).unwrap();
        assert_eq!(fixed_share.bound_percent(), 40);
    }

    #[test]
    fn an_operator_names_a_gpu_by_index_or_uuid() {
        assert_eq!(GpuSelector::parse("1"), Ok(GpuSelector::Index(1)));
        assert_eq!(
            GpuSelector::parse(" GPU-ab12 "),
            Ok(GpuSelector::Uuid("GPU-ab12".to_owned()))
        );
        assert_eq!(GpuSelector::parse("99"), Err(SpecError::BadIndex(99)));
        assert!(GpuSelector::parse("+1").is_err());
        assert!(GpuSelector::parse("gpu zero").is_err());
    }

    #[test]
    fn invalid_specs_are_named() {
        assert_eq!(gpu(Some(0), None, None), Err(SpecError::BadCap(0)));
        assert_eq!(gpu(Some(101), None, None), Err(SpecError::BadCap(101)));
        assert_eq!(gpu(None, Some(101), None), Err(SpecError::BadShare(101)));
        assert_eq!(
            gpu(Some(20), Some(30), None),
            Err(SpecError::ShareAboveCap { share: 30, cap: 20 })
        );
        assert_eq!(
            GpuSpec::new(GpuSelector::Index(0), 0, 0, None, None, None),
            Err(SpecError::ZeroWeight)
        );
        assert!(GpuSelector::uuid("GPU-3430f778-7a25-704c-9090-8b0bb2478114").is_ok());
        assert!(GpuSelector::uuid("MIG-abc").is_ok());
        assert!(GpuSelector::uuid("3430f778").is_err());
        assert!(GpuSelector::uuid("GPU-a b").is_err());
        assert!(GpuSelector::index(16).is_err());
    }

    #[test]
    fn tokens_compare_and_hide() {
        let t = Token::new("s3cret").unwrap();
        assert!(t.matches("s3cret"));
        assert!(!t.matches("s3cre"));
        assert!(!t.matches("s3creT"));
        assert_eq!(format!("{t:?}"), "Token(***)");
        assert!(matches!(Token::new(""), Err(SpecError::EmptyToken)));
        assert!(Token::new("a b").is_err());
    }

    #[test]
    fn duplicates_are_refused() {
        let a = GpuSpec::new(GpuSelector::uuid("GPU-aa").unwrap(), 0, 1, None, None, None).unwrap();
        let b = GpuSpec::new(GpuSelector::uuid("gpu-AA").unwrap(), 0, 1, None, None, None).unwrap();
        assert!(matches!(
            check_gpus(&[a, b]),
            Err(SpecError::DuplicateGpu(_))
        ));
    }
}
