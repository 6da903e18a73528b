//! Lifecycle logic: `cuInit` is where CUDA is refused when the process's
//! limits cannot be had.

use crate::error::{LimiterError, Result};
use crate::grant::Grant;
use crate::runtime::{self, State};
use crate::sys::CUresult;

use super::hooks::cuInit;

/// `cuInit`: `CUDA_ERROR_NOT_INITIALIZED` under a broken configuration, an
/// unpatchable driver, or (under a hypervisor) no grant and no local limit,
/// so the program fails where CUDA starts instead of running without its
/// limits. Each cause printed its one line when it was found.
pub fn init(original: cuInit::Signature, flags: u32) -> Result<CUresult> {
    if let Some(State::Refusing(message)) = runtime::get() {
        eprintln!("{message}; cuInit refused");
        return Err(LimiterError::Misconfigured("configuration error"));
    }
    if runtime::refusal().is_some() {
        return Err(LimiterError::Misconfigured("driver cannot be patched"));
    }
    if runtime::link().is_none() {
        return Err(LimiterError::Bypass("no hypervisor to wait for"));
    }
    // The driver first: registration tells the hypervisor which GPUs this
    // process sees, which needs an initialised driver.
    // SAFETY: the caller's own argument.
    let result = unsafe { original(flags) };
    if !result.is_success() {
        return Ok(result);
    }
    match runtime::grant() {
        Some(Grant::Refused) => Err(LimiterError::Misconfigured("no limits granted")),
        _ => Ok(result),
    }
}
