//! MPS required (`CUDA_LIMITER_MPS=required`, set for pods on a co-run GPU):
//! the process must run as a client of the GPU's MPS server, whose active
//! thread percentage keeps it off the SMs reserved for latency pods. The
//! driver falls back to running without MPS, silently, when the control
//! daemon is down or refuses the client; such a process would take every SM.
//! So after the driver's own `cuInit` succeeds, every device is asked
//! whether MPS is in effect (`CU_DEVICE_ATTRIBUTE_MPS_ENABLED`); one that
//! says no, or a question the driver cannot answer, refuses CUDA (`cuInit`
//! fails) with one line, like the limiter's other refusals.
//!
//! Its share of the SMs: MPS fixes a client's active thread percentage
//! (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) when the driver starts. Provisioning
//! sets what a client of the pod may take beside pods of the other class;
//! the node's hypervisor writes into the pod's limits what a client that
//! starts now takes (the whole GPU while no pod of the other class shares
//! it). So before the driver's `cuInit` that value replaces the variable
//! ([`MpsRequirement::take_sm_share`]). A batch client that took no more
//! than the provisioned share is kept off the SMs reserved for latency pods,
//! and its launches are not held for them; one that took more (it started
//! alone) is held by the priority classes while a latency pod works.
//!
//! The GPUs it is shown: its server serves one co-run GPU, which CUDA
//! shows it alone; NVML, which knows nothing of MPS, must show it the same
//! one through `CUDA_VISIBLE_DEVICES`, and its pod must be given that GPU
//! alone. At load, an unset variable is set to the GPU the node daemon
//! names for the pipe folder ([`pin`]); after `cuInit` the views must agree
//! ([`view`]), or CUDA is refused like a client running without MPS.

mod pin;
mod view;

use std::sync::OnceLock;

use gpushare_utils::shm::Trust;

use crate::config::MpsMode;
use crate::context::Context;
use crate::driver::{Driver, DriverError};
use pin::Pinned;
pub(crate) use view::Disagreement;

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
    #[error("the driver does not say which GPU each device is")]
    NoUuid,
    #[error("{0}")]
    Shown(#[from] Disagreement),
}

/// The MPS client's share of the SMs, in percent.
pub(crate) const ACTIVE_THREAD_VARIABLE: &str = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE";

/// This process's MPS requirement and, once checked, its outcome.
pub(crate) struct MpsRequirement {
    mode: MpsMode,
    checked: OnceLock<Result<(), MpsError>>,
    /// The SMs the share this client took gives it.
    sms: OnceLock<CorunSms>,
}

/// The SMs an MPS client of a co-run GPU runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CorunSms {
    /// More than its class's part beside the other class: all of them, for
    /// a client that started with no pod of the other class there.
    WholeGpu,
    /// Its class's part: for a batch client all but those reserved for
    /// latency pods (its kernels and theirs run side by side, so its batch
    /// launches are never held); for a latency client the reserve.
    OffReserve,
}

/// The share of the SMs an MPS client takes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct SmShare {
    /// The variable's value as provisioned: the client's share beside pods
    /// of the other class (`None`: unset or not a percentage).
    pub provisioned: Option<f64>,
    /// What the pod's limits give a client that starts now.
    pub given: Option<u8>,
}

impl SmShare {
    /// The value the variable takes: the given share where there is one
    /// and the variable was provisioned (it is only ever replaced).
    pub(crate) fn replacement(&self) -> Option<u8> {
        self.provisioned.and(self.given)
    }

    /// Whether the client stays within the provisioned share, so off the
    /// SMs reserved for latency pods.
    pub(crate) fn off_reserve(&self) -> bool {
        match (self.provisioned, self.replacement()) {
            (Some(provisioned), Some(taken)) => f64::from(taken) <= provisioned,
            (Some(_), None) => true,
            (None, _) => false,
        }
    }
}

/// A percentage as MPS reads it: a number in (0, 100].
fn percentage(text: &str) -> Option<f64> {
    let value: f64 = text.trim().parse().ok()?;
    (value > 0.0 && value <= 100.0).then_some(value)
}

impl MpsRequirement {
    pub(crate) fn new(mode: MpsMode) -> Self {
        Self {
            mode,
            checked: OnceLock::new(),
            sms: OnceLock::new(),
        }
    }

    /// Before the driver's `cuInit`, where MPS is required: replaces the
    /// provisioned share of the SMs by the one the pod's limits give now
    /// (`given`, asked only here). Returns the SMs the client runs on;
    /// `None` where MPS is not required. Decided once.
    pub(crate) fn take_sm_share(&self, given: impl FnOnce() -> Option<u8>) -> Option<CorunSms> {
        if !self.is_required() {
            return None;
        }
        Some(*self.sms.get_or_init(|| {
            let share = SmShare {
                provisioned: std::env::var(ACTIVE_THREAD_VARIABLE)
                    .ok()
                    .as_deref()
                    .and_then(percentage),
                given: given(),
            };
            if let Some(taken) = share.replacement() {
                // SAFETY: the variable exists (provisioned), so glibc's
                // setenv stores a new string in its slot of the environment
                // without moving the array, and never frees the old string:
                // a thread reading the environment meanwhile sees one value
                // or the other. The driver reads it when it initialises,
                // which is after this call.
                unsafe { std::env::set_var(ACTIVE_THREAD_VARIABLE, taken.to_string()) };
                tracing::info!(
                    taken,
                    provisioned = share.provisioned,
                    "MPS share of the SMs given by the pod's limits"
                );
            }
            if share.off_reserve() {
                CorunSms::OffReserve
            } else {
                CorunSms::WholeGpu
            }
        }))
    }

    pub(crate) fn is_required(&self) -> bool {
        self.mode == MpsMode::Required
    }

    /// At load, before the program reads its environment: where MPS is
    /// required, an unset `CUDA_VISIBLE_DEVICES` becomes the GPU the pipe
    /// folder's server serves ([`pin`]); `trust`, who may name it.
    ///
    /// # Safety
    ///
    /// As [`pin::pin_served_gpu`]: no other thread uses the environment.
    pub(crate) unsafe fn pin_served_gpu(&self, trust: &Trust) {
        if !self.is_required() {
            return;
        }
        // SAFETY: forwarded from the caller.
        match unsafe { pin::pin_served_gpu(trust) } {
            Pinned::To(uuid) => {
                tracing::info!(gpu = %uuid, "CUDA_VISIBLE_DEVICES set to the GPU of the MPS server");
            }
            Pinned::Unknown(why) => {
                tracing::debug!(%why, "the MPS server's GPU is not named; CUDA_VISIBLE_DEVICES stays unset");
            }
            Pinned::AlreadySet | Pinned::NoPipeFolder => {}
        }
    }

    /// After the driver's `cuInit` succeeded: `Ok` when MPS is not required,
    /// or every device is an MPS client and the process is shown its
    /// server's GPUs alone ([`view`]). Checked once (whether a process is an
    /// MPS client is fixed when the driver initialises); a failure prints
    /// its line the first time.
    pub(crate) fn verify(&self, context: &Context) -> Result<(), &MpsError> {
        self.decide(|| {
            let driver = context.driver().ok_or(MpsError::NoDriver)?;
            check(driver)?;
            let limits = context.published_limits();
            let views = view::Views::gather(driver, context.nvml(), limits.as_ref())
                .ok_or(MpsError::NoUuid)?;
            Ok(views.agree()?)
        })
    }

    /// `check`'s outcome where MPS is required, decided once.
    fn decide(&self, check: impl FnOnce() -> Result<(), MpsError>) -> Result<(), &MpsError> {
        if !self.is_required() {
            return Ok(());
        }
        self.checked
            .get_or_init(|| {
                let outcome = check();
                match &outcome {
                    Ok(()) => {}
                    Err(error @ MpsError::Shown(_)) => eprintln!(
                        "cuda-limiter: CUDA_LIMITER_MPS=required and this MPS client is shown GPUs its server does not serve: {error}; cuInit refused"
                    ),
                    Err(error) => eprintln!(
                        "cuda-limiter: CUDA_LIMITER_MPS=required but MPS is not in effect: {error}; cuInit refused"
                    ),
                }
                outcome
            })
            .as_ref()
            .copied()
    }
}

/// Asks every device whether it runs under MPS.
fn check(driver: &Driver) -> Result<(), MpsError> {
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
    fn not_required_never_looks_and_a_refusal_is_decided_once() {
        let optional = MpsRequirement::new(MpsMode::Optional);
        assert!(!optional.is_required());
        assert_eq!(optional.decide(|| panic!("not asked")), Ok(()));
        let required = MpsRequirement::new(MpsMode::Required);
        assert!(required.is_required());
        assert_eq!(
            required.decide(|| Err(MpsError::NoDriver)),
            Err(&MpsError::NoDriver)
        );
        // Decided once.
        assert_eq!(required.decide(|| Ok(())), Err(&MpsError::NoDriver));
    }

    #[test]
    fn the_given_share_replaces_a_provisioned_one_and_says_whether_it_keeps_off_the_reserve() {
        let share = |provisioned: Option<f64>, given: Option<u8>| SmShare { provisioned, given };
        // Alone: the whole GPU, past the provisioned 80%: held by classes.
        assert_eq!(share(Some(80.0), Some(100)).replacement(), Some(100));
        assert!(!share(Some(80.0), Some(100)).off_reserve());
        // Beside a latency pod, or a fixed share: within the provisioned.
        assert!(share(Some(80.0), Some(80)).off_reserve());
        assert!(share(Some(80.0), Some(50)).off_reserve());
        // Nothing given (no limits published yet): the provisioned stands.
        assert_eq!(share(Some(80.0), None).replacement(), None);
        assert!(share(Some(80.0), None).off_reserve());
        // Never provisioned: never set, and the client may be anywhere.
        assert_eq!(share(None, Some(100)).replacement(), None);
        assert!(!share(None, Some(100)).off_reserve());
        assert_eq!(percentage(" 80 "), Some(80.0));
        assert_eq!(percentage("12.5"), Some(12.5));
        for bad in ["0", "101", "-5", "most", ""] {
            assert_eq!(percentage(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn an_optional_process_takes_no_share() {
        let optional = MpsRequirement::new(MpsMode::Optional);
        assert_eq!(optional.take_sm_share(|| panic!("not asked")), None);
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
