//! Pod identity.

use std::fmt;
use std::str::FromStr;

use super::error::{POD_SYNTAX, quoted};

/// Identity of a pod: 1 to 64 characters of `[A-Za-z0-9_.-]`.
///
/// Processes with the same pod id share one quota.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(String);

impl PodId {
    /// Longest accepted pod id, in bytes.
    pub const MAX_LEN: usize = 64;

    /// Validates `id` (no trimming).
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidPodId> {
        let id = id.into();
        let valid = (1..=Self::MAX_LEN).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if valid {
            Ok(Self(id))
        } else {
            Err(InvalidPodId(id))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for PodId {
    /// The pod of processes started without `CUDA_LIMITER_POD`: `default`.
    fn default() -> Self {
        Self("default".to_owned())
    }
}

impl fmt::Display for PodId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for PodId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for PodId {
    type Err = InvalidPodId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// A string that is not a valid [`PodId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is not a pod id (expected {POD_SYNTAX})", quoted(.0))]
pub struct InvalidPodId(String);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn pod_and_hypervisor() {
        let c = ok(&[]);
        assert_eq!(c.pod.as_str(), "default");
        assert_eq!(c.hypervisor, None);
        let c = ok(&[
            ("CUDA_LIMITER_POD", " team-a.job_7 "),
            ("CUDA_LIMITER_HYPERVISOR", " http://127.0.0.1:8000 "),
        ]);
        assert_eq!(c.pod.to_string(), "team-a.job_7");
        assert_eq!(c.hypervisor.as_deref(), Some("http://127.0.0.1:8000"));

        let long = "a".repeat(64);
        let too_long = "a".repeat(65);
        let table: &[(&str, bool)] = &[
            ("default", true),
            ("A-Za-z0-9_.-", true),
            (long.as_str(), true),
            ("x", true),
            ("", false),
            (too_long.as_str(), false),
            ("pod/1", false),
            ("pod 1", false),
            ("pöd", false),
            ("pod:1", false),
        ];
        for &(id, valid) in table {
            assert_eq!(PodId::new(id).is_ok(), valid, "{id:?}");
            assert_eq!(id.parse::<PodId>().is_ok(), valid, "{id:?}");
            assert_eq!(cfg(&[("CUDA_LIMITER_POD", id)]).is_ok(), valid, "{id:?}");
        }
        assert_eq!(
            err(&[("CUDA_LIMITER_POD", "pod/1")]).to_string(),
            "CUDA_LIMITER_POD=\"pod/1\" is not a pod id (expected 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-')"
        );
        assert_eq!(
            err(&[("CUDA_LIMITER_HYPERVISOR", "  ")]).to_string(),
            "CUDA_LIMITER_HYPERVISOR=\"  \" is empty (expected an address such as http://127.0.0.1:8000, or leave it unset for local mode)"
        );
    }
}
