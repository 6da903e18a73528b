//! Pod classes: `latency` pods are served first on a GPU; `batch` pods (the
//! default) are held while a latency pod on the same GPU has work in flight.
//!
//! `CUDA_LIMITER_CLASS_<i>` (device `i`) beats `CUDA_LIMITER_CLASS` (all
//! devices); the value is `latency` or `batch`, case-insensitive.

use std::fmt;

use super::MAX_DEVICES;

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

/// The classes configured per device index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeviceClasses {
    all: Option<PodClass>,
    per: [Option<PodClass>; MAX_DEVICES],
}

impl DeviceClasses {
    /// Whether no class variable was set.
    pub fn is_empty(&self) -> bool {
        self.all.is_none() && self.per.iter().all(Option::is_none)
    }

    /// Whether any device's class is latency.
    pub fn any_latency(&self) -> bool {
        std::iter::once(&self.all)
            .chain(&self.per)
            .any(|class| *class == Some(PodClass::Latency))
    }

    /// Sets the class of `device` (`None`: all devices).
    pub fn set(&mut self, device: Option<u32>, class: PodClass) {
        match device.and_then(|i| self.per.get_mut(i as usize)) {
            Some(slot) => *slot = Some(class),
            None => self.all = Some(class),
        }
    }

    /// The class of device `device`: its own, else all devices', else batch.
    pub fn resolve(&self, device: u32) -> PodClass {
        self.per
            .get(device as usize)
            .copied()
            .flatten()
            .or(self.all)
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn classes_per_device_beat_all_devices() {
        let c = ok(&[]);
        assert!(c.class.is_empty());
        assert_eq!(c.class.resolve(0), PodClass::Batch);
        let c = ok(&[
            ("CUDA_LIMITER_CLASS", " Latency "),
            ("CUDA_LIMITER_CLASS_1", "batch"),
        ]);
        assert!(!c.class.is_empty());
        assert_eq!(c.class.resolve(0), PodClass::Latency);
        assert_eq!(c.class.resolve(1), PodClass::Batch);
        assert_eq!(c.class.resolve(15), PodClass::Latency);
        let c = ok(&[("CUDA_LIMITER_CLASS_2", "latency")]);
        assert_eq!(c.class.resolve(2), PodClass::Latency);
        assert_eq!(c.class.resolve(0), PodClass::Batch);
        assert!(c.class.any_latency());
        assert!(!ok(&[("CUDA_LIMITER_CLASS", "batch")]).class.any_latency());
        assert!(!ok(&[]).class.any_latency());
    }

    #[test]
    fn a_bad_class_is_an_error() {
        assert_eq!(
            err(&[("CUDA_LIMITER_CLASS", "urgent")]).to_string(),
            "CUDA_LIMITER_CLASS=\"urgent\" is not a class (expected latency or batch)"
        );
        assert!(matches!(
            err(&[("CUDA_LIMITER_CLASS_x", "batch")]),
            crate::config::ConfigError::BadSuffix { .. }
        ));
    }

    #[test]
    fn codes_round_trip_and_unknown_codes_are_batch() {
        for class in [PodClass::Batch, PodClass::Latency] {
            assert_eq!(PodClass::from_code(class.code()), class);
            assert_eq!(PodClass::parse(class.as_str()), Some(class));
        }
        assert_eq!(PodClass::from_code(7), PodClass::Batch);
        assert_eq!(PodClass::parse(""), None);
    }
}
