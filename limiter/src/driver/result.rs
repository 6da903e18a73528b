//! The one conversion of a driver status into a Rust error: the limiter's
//! own driver calls end in [`CUresult::result`], and a failure is a
//! [`DriverError`] from there on. Detours that hand the application the
//! driver's answer keep the raw `CUresult`.

use crate::sys::CUresult;

/// A driver call that did not succeed: the status it returned, never
/// `CUDA_SUCCESS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("CUDA driver error {} ({})", .0.0, self.name())]
pub(crate) struct DriverError(CUresult);

impl DriverError {
    /// No such function in this driver (an optional symbol not resolved).
    pub(crate) const NOT_FOUND: Self = Self(CUresult::ERROR_NOT_FOUND);
    /// An argument out of range.
    pub(crate) const INVALID_VALUE: Self = Self(CUresult::ERROR_INVALID_VALUE);
    /// No memory left (here: host memory the limiter maps itself).
    pub(crate) const OUT_OF_MEMORY: Self = Self(CUresult::ERROR_OUT_OF_MEMORY);

    /// The status as the driver returned it, to hand on to the application.
    pub(crate) fn code(self) -> CUresult {
        self.0
    }

    /// The status's name in `cuda.h`, for the statuses the limiter knows.
    pub(crate) fn name(self) -> &'static str {
        match self.0 {
            CUresult::ERROR_INVALID_VALUE => "CUDA_ERROR_INVALID_VALUE",
            CUresult::ERROR_OUT_OF_MEMORY => "CUDA_ERROR_OUT_OF_MEMORY",
            CUresult::ERROR_NOT_INITIALIZED => "CUDA_ERROR_NOT_INITIALIZED",
            CUresult::ERROR_INVALID_CONTEXT => "CUDA_ERROR_INVALID_CONTEXT",
            CUresult::ERROR_NOT_FOUND => "CUDA_ERROR_NOT_FOUND",
            CUresult::ERROR_NOT_READY => "CUDA_ERROR_NOT_READY",
            _ => "unnamed",
        }
    }
}

impl From<DriverError> for CUresult {
    fn from(error: DriverError) -> Self {
        error.0
    }
}

impl CUresult {
    /// `Ok` for `CUDA_SUCCESS`, else the status as a [`DriverError`].
    #[inline]
    pub(crate) fn result(self) -> Result<(), DriverError> {
        if self.is_success() {
            Ok(())
        } else {
            Err(DriverError(self))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::DriverError;
    use crate::sys::CUresult;

    #[test]
    fn only_success_is_ok() {
        assert_eq!(CUresult::SUCCESS.result(), Ok(()));
        let error = CUresult::ERROR_OUT_OF_MEMORY.result().unwrap_err();
        assert_eq!(error.code(), CUresult::ERROR_OUT_OF_MEMORY);
        assert_eq!(CUresult::from(error), CUresult::ERROR_OUT_OF_MEMORY);
        assert_eq!(
            error.to_string(),
            "CUDA driver error 2 (CUDA_ERROR_OUT_OF_MEMORY)"
        );
        assert_eq!(
            CUresult(999).result().unwrap_err().to_string(),
            "CUDA driver error 999 (unnamed)"
        );
        assert_eq!(DriverError::NOT_FOUND.code(), CUresult::ERROR_NOT_FOUND);
    }
}
