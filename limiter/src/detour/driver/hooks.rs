//! Lifecycle detours, installed only when the configuration is broken.

use super::ops;
use crate::sys::CUresult;

gpushare_macros::detours! {
    /// Installed instead of the limits when the configuration cannot be read.
    pub static DRIVER_DETOURS;

    /// Refuses to initialise CUDA.
    required fn cuInit(flags: u32) -> CUresult => ops::init;
}
