//! The pod's class per device, from `CUDA_LIMITER_CLASS_<i>` (device `i`),
//! which beats `CUDA_LIMITER_CLASS` (all devices); the value is `latency` or
//! `batch`, case-insensitive ([`PodClass::parse`]). `latency` pods are served
//! first on a GPU; `batch` pods (the default) are held while a latency pod on
//! the same GPU has work in flight.

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::pod::PodClass;

/// The classes configured per device index.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct DeviceClasses {
    all: Option<PodClass>,
    per: [Option<PodClass>; MAX_DEVICES],
}

impl DeviceClasses {
    /// Whether no class variable was set.
    pub(crate) fn is_empty(&self) -> bool {
        self.all.is_none() && self.per.iter().all(Option::is_none)
    }

    /// Whether any device's class is latency.
    pub(crate) fn any_latency(&self) -> bool {
        std::iter::once(&self.all)
            .chain(&self.per)
            .any(|class| *class == Some(PodClass::Latency))
    }

    /// Sets the class of `device` (`None`: all devices).
    pub(crate) fn set(&mut self, device: Option<u32>, class: PodClass) {
        match device.and_then(|i| self.per.get_mut(i as usize)) {
            Some(slot) => *slot = Some(class),
            None => self.all = Some(class),
        }
    }

    /// The class of device `device`: its own, else all devices', else batch.
    pub(crate) fn resolve(&self, device: u32) -> PodClass {
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
}
