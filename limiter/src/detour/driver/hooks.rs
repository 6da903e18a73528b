//! Lifecycle detours: `cuInit`, where CUDA is refused without limits.

use super::ops;
use crate::error::Result;
use crate::sys::CUresult;

gpushare_macros::detours! {
    /// Installed with every set of limits, and alone when CUDA is refused.
    pub static DRIVER_DETOURS;

    /// Refuses to initialise CUDA.
    required fn cuInit(flags: u32) -> CUresult => init;
}

fn init(original: cuInit::Signature, flags: u32) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    ops::init(|| unsafe { original(flags) })
}
