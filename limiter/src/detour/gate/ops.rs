//! The gate's logic: the call waits while its pod is swapped out, then
//! goes to the driver as it was made; nothing is left to do after it.

use gpushare_hook::AfterCall;

use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::sys::CUresult;

/// The pod is on its GPUs: the call goes on, and nothing follows it.
pub(super) struct Resident;

impl AfterCall<CUresult> for Resident {
    #[inline(always)]
    fn after(self, _result: CUresult) {}
}

/// Returns once the pod is resident (at once, but for a stamp of the call,
/// while it is).
#[inline(always)]
pub(super) fn resident() -> Result<Resident> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter.resident();
    Ok(Resident)
}
