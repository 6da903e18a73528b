//! Lifecycle logic: `cuInit` is where CUDA is refused when the process's
//! limits cannot be had.

use crate::entry::{self, State};
use crate::error::{LimiterError, Pass, Result};
use crate::grant::Grant;
use crate::sys::CUresult;

/// `cuInit`: `CUDA_ERROR_NOT_INITIALIZED` under a broken configuration, an
/// unpatchable driver, a JSON map naming one device twice (by index and by
/// UUID), MPS required but not in effect or showing the process GPUs its
/// MPS server does not serve, or (under a
/// hypervisor) no grant and no local limit, so the program fails where CUDA
/// starts instead of running without its limits. A broken configuration says so once, here; the other causes
/// printed their one line when they were found.
/// `initialise` is the driver's original, as a closure from the adapter.
pub(super) fn init(initialise: impl FnOnce() -> CUresult) -> Result<CUresult> {
    let limiter = match entry::state() {
        Some(State::Refusing(refusal)) => {
            refusal.tell();
            return Err(LimiterError::Misconfigured("configuration error"));
        }
        Some(State::Limiting(limiter)) => limiter,
        _ => return Err(LimiterError::Bypass(Pass::LimitsOff)),
    };
    if limiter.refusal().is_some() {
        return Err(LimiterError::Misconfigured("driver cannot be patched"));
    }
    if limiter.context.link().is_none()
        && !limiter.mps.is_required()
        && !limiter.maps_mix_indices_and_uuids()
    {
        return Err(LimiterError::Bypass(Pass::NoHypervisor));
    }
    // Before the driver reads it: an MPS client's share of the SMs.
    let sms = limiter
        .mps
        .take_sm_share(|| limiter.context.published_limits()?.sm_percent());
    if let (Some(sms), Some(throttle)) = (sms, &limiter.compute) {
        throttle.join_corun(sms);
    }
    // The driver first: registration tells the hypervisor which GPUs this
    // process sees, and the devices say whether MPS is on, both of which
    // need an initialised driver.
    let result = initialise();
    if !result.is_success() {
        return Ok(result);
    }
    // Which UUID each index has is known now.
    if let Some(message) = limiter.device_named_twice() {
        entry::refuse(message);
        return Err(LimiterError::Misconfigured("configuration error"));
    }
    if limiter.mps.verify(&limiter.context).is_err() {
        return Err(LimiterError::Misconfigured(
            "MPS required but not in effect",
        ));
    }
    if limiter.context.link().is_none() {
        return Ok(result);
    }
    match limiter.context.grant() {
        Grant::Refused => Err(LimiterError::Misconfigured("no limits granted")),
        _ => Ok(result),
    }
}
