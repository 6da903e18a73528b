//! Lifecycle detours: `cuInit`, where CUDA is refused without limits.

use super::ops;
use crate::sys::CUresult;

gpushare_macros::detours! {
    /// Installed with every set of limits, and alone when CUDA is refused.
    pub static DRIVER_DETOURS;

    /// Refuses to initialise CUDA.
    required fn cuInit(flags: u32) -> CUresult => ops::init;
}
