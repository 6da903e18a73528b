//! Lifecycle logic.

use crate::error::{LimiterError, Result};
use crate::runtime::{self, State};
use crate::sys::CUresult;

use super::hooks::cuInit;

/// `cuInit` under a broken configuration: the one-line error again, and
/// `CUDA_ERROR_NOT_INITIALIZED`, so the program fails where CUDA starts
/// instead of running without its limits.
pub fn init(_original: cuInit::Signature, _flags: u32) -> Result<CUresult> {
    match runtime::get() {
        Some(State::Refusing(message)) => {
            eprintln!("{message}; cuInit refused");
            Err(LimiterError::Misconfigured("configuration error"))
        }
        _ => Err(LimiterError::Bypass("configuration is valid")),
    }
}
