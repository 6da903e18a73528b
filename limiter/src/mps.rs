//! MPS required (`CUDA_LIMITER_MPS=required`, set for pods on a co-run GPU):
//! the process must run as a client of the GPU's MPS server, whose active
//! thread percentage keeps it off the SMs reserved for latency pods. The
//! driver falls back to running without MPS, silently, when the control
//! daemon is down or refuses the client; such a process would take every SM.
//! So after the driver's own `cuInit` succeeds, every device is asked
//! whether MPS is in effect (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`); one that
//! says no, or a question the driver cannot answer, refuses CUDA (`cuInit`
//! fails) with one line, like the limiter's other refusals.

use std::sync::OnceLock;

use crate::config::MpsMode;
use crate::driver::{Driver, DriverError};

/// Why MPS is not known to be in effect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum MpsError {
    #[error("the driver's functions are not resolved")]
    NoDriver,
    #[error("the driver does not say how many devices there are")]
    NoDeviceCount,
    #[error("device {device} does not say whether MPS is on ({error})")]
    Query { device: u32, error: DriverError },
    #[error(
        "device {device} runs without MPS (the MPS control daemon is down or refused this client)"
    )]
    Off { device: u32 },
}

/// This process's MPS requirement and, once checked, its outcome.
pub(crate) struct MpsRequirement {
    mode: MpsMode,
    checked: OnceLock<Result<(), MpsError>>,
}

impl MpsRequirement {
    pub(crate) fn new(mode: MpsMode) -> Self {
        Self {
            mode,
            checked: OnceLock::new(),
        }
    }

    pub(crate) fn is_required(&self) -> bool {
        self.mode == MpsMode::Required
    }

    /// After the driver's `cuInit` succeeded: `Ok` when MPS is not required
    /// or every device is an MPS client. Checked once (whether a process is
    /// an MPS client is fixed when the driver initialises); a failure prints
    /// its line the first time.
    pub(crate) fn verify(&self, driver: Option<&Driver>) -> Result<(), &MpsError> {
        if !self.is_required() {
            return Ok(());
        }
        self.checked
            .get_or_init(|| {
                let outcome = check(driver);
                if let Err(error) = &outcome {
                    eprintln!(
                        "cuda-limiter: CUDA_LIMITER_MPS=required but MPS is not in effect: {error}; cuInit refused"
                    );
                }
                outcome
            })
            .as_ref()
            .copied()
    }
}

/// Asks every device whether it runs under MPS.
fn check(driver: Option<&Driver>) -> Result<(), MpsError> {
    let driver = driver.ok_or(MpsError::NoDriver)?;
    let count = driver.device_count().ok_or(MpsError::NoDeviceCount)?;
    (0..count).try_for_each(|device| match driver.mps_enabled(device) {
        Ok(true) => Ok(()),
        Ok(false) => Err(MpsError::Off { device }),
        Err(error) => Err(MpsError::Query { device, error }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_required_never_looks_and_required_without_a_driver_refuses() {
        let optional = MpsRequirement::new(MpsMode::Optional);
        assert!(!optional.is_required());
        assert_eq!(optional.verify(None), Ok(()));
        let required = MpsRequirement::new(MpsMode::Required);
        assert!(required.is_required());
        assert_eq!(required.verify(None), Err(&MpsError::NoDriver));
        // Decided once.
        assert_eq!(required.verify(None), Err(&MpsError::NoDriver));
    }

    #[test]
    fn the_reasons_read_as_one_line() {
        let off = MpsError::Off { device: 1 }.to_string();
        assert!(off.contains("device 1 runs without MPS"), "{off}");
        let query = MpsError::Query {
            device: 0,
            error: DriverError::INVALID_VALUE,
        }
        .to_string();
        assert!(query.contains("CUDA_ERROR_INVALID_VALUE"), "{query}");
        assert!(!query.contains('\n'));
    }
}
