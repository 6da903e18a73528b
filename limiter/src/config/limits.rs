//! Resolved limits: compute policies and limits, and the per-device key table
//! resolved in the precedence order of the [module documentation](super).

use std::fmt;

use super::ConfigError;

/// How a compute limit treats SM time other pods leave idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) enum ComputePolicy {
    /// Never more than the limit.
    #[default]
    Fixed,
    /// At least the limit when contended; idle time up to the soft limit.
    Elastic,
    /// No compute limit. Parsed from the environment, never stored in a
    /// [`ComputeLimit`]: it resolves to "unlimited".
    None,
}

impl ComputePolicy {
    /// `fixed`, `elastic` or `none`, case-insensitive, surrounding whitespace allowed.
    pub(crate) fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        [
            ("fixed", Self::Fixed),
            ("elastic", Self::Elastic),
            ("none", Self::None),
        ]
        .into_iter()
        .find_map(|(name, policy)| name.eq_ignore_ascii_case(s).then_some(policy))
    }

    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Elastic => "elastic",
            Self::None => "none",
        }
    }
}

impl fmt::Display for ComputePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A limited share of one device's SM time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ComputeLimit {
    /// Guaranteed (elastic) or maximum (fixed) share, 1 to 99.
    pub percent: u8,
    /// [`ComputePolicy::Fixed`] or [`ComputePolicy::Elastic`].
    pub policy: ComputePolicy,
    /// Elastic ceiling, `percent..=99`; `None` means the whole device. Always
    /// `None` under [`ComputePolicy::Fixed`].
    pub soft_percent: Option<u8>,
}

impl ComputeLimit {
    /// A fixed limit of `percent`.
    pub(crate) fn fixed(percent: u8) -> Self {
        Self {
            percent,
            policy: ComputePolicy::Fixed,
            soft_percent: None,
        }
    }

    /// The most SM time the pod may use: the limit when fixed, the soft limit
    /// (or 100) when elastic.
    pub(crate) fn ceiling(&self) -> u8 {
        match self.policy {
            ComputePolicy::Elastic => self.soft_percent.unwrap_or(100),
            ComputePolicy::Fixed | ComputePolicy::None => self.percent,
        }
    }
}

/// Which devices a key applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Device {
    All,
    Index(u32),
    /// Lowercased.
    Uuid(String),
}

impl Device {
    pub(super) fn matches(&self, index: u32, uuid: Option<&str>) -> bool {
        match self {
            Self::All => true,
            Self::Index(i) => *i == index,
            Self::Uuid(u) => uuid.is_some_and(|x| x.eq_ignore_ascii_case(u)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry<T> {
    pub(super) rank: u8,
    pub(super) device: Device,
    /// `None`: explicitly unlimited.
    pub(super) limit: Option<T>,
    pub(super) source: String,
    /// The variable and key of a JSON map's member (`None`: a plain variable).
    pub(super) member: Option<(String, String)>,
}

/// The key that decided a device's limit, from [`DeviceLimits::lookup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Resolved<'a, T> {
    /// `None`: the key says "unlimited" (e.g. a size of 0).
    pub limit: Option<T>,
    /// The variable (and JSON key) it came from, e.g. `CUDA_DEVICE_MEMORY_LIMIT_0`
    /// or `TENSOR_FUSION_CUDA_MEM_LIMIT["gpu-…"]`.
    pub source: &'a str,
}

/// Limits keyed by device index, by GPU UUID and for all devices, resolved in
/// the precedence order of the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DeviceLimits<T> {
    /// Sorted by rank (lower wins); entries of one rank never name the same device.
    entries: Vec<Entry<T>>,
}

impl<T> Default for DeviceLimits<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
        }
    }
}

impl<T> DeviceLimits<T> {
    pub(super) fn push(&mut self, rank: u8, device: Device, limit: Option<T>, source: String) {
        self.insert(Entry {
            rank,
            device,
            limit,
            source,
            member: None,
        });
    }

    /// A member `key` of the JSON map in variable `var`.
    pub(super) fn push_member(
        &mut self,
        rank: u8,
        device: Device,
        limit: Option<T>,
        var: &str,
        key: &str,
    ) {
        self.insert(Entry {
            rank,
            device,
            limit,
            source: format!("{var}[{key:?}]"),
            member: Some((var.to_owned(), key.to_owned())),
        });
    }

    fn insert(&mut self, entry: Entry<T>) {
        let at = self.entries.partition_point(|e| e.rank <= entry.rank);
        self.entries.insert(at, entry);
    }

    /// Whether a JSON map names devices both by index and by UUID: only
    /// then can one device be named twice, which only the driver can tell
    /// ([`Self::named_twice`]).
    pub(crate) fn mixes_indices_and_uuids(&self) -> bool {
        let members = || self.entries.iter().filter(|e| e.member.is_some());
        members().any(|e| matches!(e.device, Device::Index(_)))
            && members().any(|e| matches!(e.device, Device::Uuid(_)))
    }

    /// The error when one JSON map names device `index`, whose UUID is
    /// `uuid`, twice: by its index and by its UUID. Which of the two would
    /// win is no answer: `{"0": 1073741824, "GPU-…": 0}` would run the GPU
    /// unlimited where its writer may have meant a quota.
    pub(crate) fn named_twice(&self, index: u32, uuid: &str) -> Option<ConfigError> {
        let member = |by_uuid: bool| {
            self.entries.iter().find_map(|e| {
                let named = match &e.device {
                    Device::Uuid(u) => by_uuid && u.eq_ignore_ascii_case(uuid),
                    Device::Index(i) => !by_uuid && *i == index,
                    Device::All => false,
                };
                named.then_some(e.member.as_ref()?)
            })
        };
        let (var, by_index) = member(false)?;
        let (uuid_var, by_uuid) = member(true)?;
        (var == uuid_var).then(|| ConfigError::JsonDuplicate {
            var: var.clone(),
            first: by_index.clone(),
            second: by_uuid.clone(),
        })
    }
}

impl<T: Copy> DeviceLimits<T> {
    /// The limit of device `index` (CUDA ordinal) with GPU UUID `uuid`; `None`
    /// when unset or explicitly unlimited.
    pub(crate) fn resolve(&self, index: u32, uuid: Option<&str>) -> Option<T> {
        self.lookup(index, uuid).and_then(|r| r.limit)
    }

    /// The key that decides device `index` with GPU UUID `uuid`; `None` when no
    /// key applies to it.
    pub(crate) fn lookup(&self, index: u32, uuid: Option<&str>) -> Option<Resolved<'_, T>> {
        self.entries
            .iter()
            .find(|e| e.device.matches(index, uuid))
            .map(|e| Resolved {
                limit: e.limit,
                source: &e.source,
            })
    }

    /// True when no variable set a key (a key meaning "unlimited" counts as set).
    pub(crate) fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// True when keys are set and every one names a GPU by UUID: then a GPU
    /// none of them names is most likely a mistyped or stale UUID, not one
    /// meant to run unlimited.
    pub(crate) fn names_only_uuids(&self) -> bool {
        !self.entries.is_empty()
            && self
                .entries
                .iter()
                .all(|entry| matches!(entry.device, Device::Uuid(_)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn policy_parsing() {
        let table: &[(&str, Option<ComputePolicy>)] = &[
            ("fixed", Some(ComputePolicy::Fixed)),
            ("FIXED", Some(ComputePolicy::Fixed)),
            (" Fixed\n", Some(ComputePolicy::Fixed)),
            ("elastic", Some(ComputePolicy::Elastic)),
            ("Elastic", Some(ComputePolicy::Elastic)),
            ("none", Some(ComputePolicy::None)),
            ("NONE", Some(ComputePolicy::None)),
            ("", None),
            ("fix", None),
            ("elastic2", None),
            ("off", None),
            ("fixed elastic", None),
        ];
        for &(input, want) in table {
            assert_eq!(ComputePolicy::parse(input), want, "{input:?}");
            if let Some(p) = want {
                assert_eq!(ComputePolicy::parse(p.as_str()), Some(p));
            }
        }
        let e = err(&[
            ("CUDA_LIMITER_SM_LIMIT", "30"),
            ("CUDA_LIMITER_SM_POLICY_2", "burst"),
        ]);
        assert_eq!(
            e.to_string(),
            "CUDA_LIMITER_SM_POLICY_2=\"burst\" is not a policy (expected fixed, elastic or none)"
        );
    }

    #[test]
    fn compute_ceiling() {
        assert_eq!(ComputeLimit::fixed(30).ceiling(), 30);
        assert_eq!(elastic(30, Some(60)).ceiling(), 60);
        assert_eq!(elastic(30, None).ceiling(), 100);
    }
}
