//! The limiter's typed outcome of a detour, converted once into what the
//! caller sees (`CUresult` or `nvmlReturn_t`).

use gpushare_utils::hook::{Disposition, IntoReturn};

use crate::sys::{CUresult, nvmlReturn_t};

/// Why a detour did not simply return the driver's answer.
#[derive(Debug, thiserror::Error)]
pub enum LimiterError {
    /// Nothing for the limiter to do here; the original runs unchanged.
    #[error("pass through: {0}")]
    Bypass(&'static str),
    /// The allocation would take the pod over its quota on this device.
    #[error("device {device}: {requested} bytes requested, {used} of {quota} in use by the pod")]
    OverQuota {
        device: usize,
        requested: u64,
        used: u64,
        quota: u64,
    },
    /// The pod's ledger is unusable, so no allocation can be accounted.
    #[error("pod ledger unavailable")]
    LedgerUnavailable,
    /// The configuration is broken: CUDA must not run without its limits.
    #[error("refusing CUDA: {0}")]
    Misconfigured(&'static str),
    /// A pointer argument the driver requires was null.
    #[error("null argument")]
    NullArgument,
}

impl IntoReturn<CUresult> for LimiterError {
    fn into_return(self) -> Disposition<CUresult> {
        match self {
            Self::Bypass(_) => Disposition::CallOriginal,
            Self::OverQuota { .. } | Self::LedgerUnavailable => {
                Disposition::Return(CUresult::ERROR_OUT_OF_MEMORY)
            }
            Self::Misconfigured(_) => Disposition::Return(CUresult::ERROR_NOT_INITIALIZED),
            Self::NullArgument => Disposition::Return(CUresult::ERROR_INVALID_VALUE),
        }
    }
}

impl IntoReturn<nvmlReturn_t> for LimiterError {
    fn into_return(self) -> Disposition<nvmlReturn_t> {
        match self {
            Self::NullArgument => Disposition::Return(nvmlReturn_t::ERROR_INVALID_ARGUMENT),
            // NVML only reports; anything else leaves the real answer alone.
            _ => Disposition::CallOriginal,
        }
    }
}

/// What detour logic returns.
pub type Result<T, E = LimiterError> = std::result::Result<T, E>;
