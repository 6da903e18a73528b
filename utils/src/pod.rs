//! Who a pod is and how it is served: its identity ([`PodId`], which names
//! its shared-memory objects and its registration) and its class on a GPU
//! ([`PodClass`], whose code both sides read in the limits object and the
//! priority table).

use std::fmt;
use std::str::FromStr;

use crate::quote::quoted;

const POD_SYNTAX: &str = "1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-'";

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

    /// The id as a string.
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

/// A pod's class on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum PodClass {
    /// Held at the launch while a latency pod on the GPU is active.
    #[default]
    Batch,
    /// Keeps its latency next to batch pods.
    Latency,
}

impl PodClass {
    /// `latency` or `batch`, case-insensitive, surrounding whitespace allowed.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        [("batch", Self::Batch), ("latency", Self::Latency)]
            .into_iter()
            .find_map(|(name, class)| name.eq_ignore_ascii_case(s).then_some(class))
    }

    /// `batch` or `latency`, as [`PodClass::parse`] accepts it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Batch => "batch",
            Self::Latency => "latency",
        }
    }

    /// Its code in shared memory (0, the zeroed state, is batch).
    pub const fn code(self) -> u32 {
        match self {
            Self::Batch => 0,
            Self::Latency => 1,
        }
    }

    /// The class of a code; an unknown code is batch (never a priority the
    /// writer did not give).
    pub const fn from_code(code: u32) -> Self {
        match code {
            1 => Self::Latency,
            _ => Self::Batch,
        }
    }
}

impl fmt::Display for PodClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Kubernetes UIDs: 36 characters of hex digits and dashes (8-4-4-4-12).
pub fn is_uid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_ids() {
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
        }
        assert_eq!(PodId::default().as_str(), "default");
        assert_eq!(
            PodId::new("pod/1").err().map(|e| e.to_string()).as_deref(),
            Some(
                "\"pod/1\" is not a pod id (expected 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-')"
            )
        );
    }

    #[test]
    fn codes_round_trip_and_unknown_codes_are_batch() {
        for class in [PodClass::Batch, PodClass::Latency] {
            assert_eq!(PodClass::from_code(class.code()), class);
            assert_eq!(PodClass::parse(class.as_str()), Some(class));
        }
        assert_eq!(PodClass::from_code(7), PodClass::Batch);
        assert_eq!(PodClass::parse(""), None);
        assert_eq!(PodClass::parse(" Latency "), Some(PodClass::Latency));
    }

    #[test]
    fn uids() {
        assert!(is_uid("0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4a"));
        assert!(!is_uid("0b7c8a52-3f1e-4a7e-9c4e-2f6f1d2c3b4"));
        assert!(!is_uid("0b7c8a52_3f1e-4a7e-9c4e-2f6f1d2c3b4a"));
        assert!(!is_uid("../../etc/passwd-aaaaaaaaaaaaaaaaaaaaaaaa"));
    }
}
