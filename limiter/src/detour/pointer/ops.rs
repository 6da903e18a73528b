//! The pointer queries' logic: a backed range's base and size from the
//! book, everything else from the driver (once the pod is resident: a
//! swapped-out range is not mapped).

use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::sys::{
    CU_POINTER_ATTRIBUTE_RANGE_SIZE, CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, CUdeviceptr,
    CUpointer_attribute,
};

/// The base and size the program asked for of the backed range holding
/// `pointer`; `Bypass` for any other memory.
pub(super) fn backed_range(pointer: CUdeviceptr) -> Result<(CUdeviceptr, u64)> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter
        .backing
        .range(pointer)
        .ok_or(LimiterError::Bypass(Pass::NotBacked))
}

/// The value of `attribute` the limiter answers for backed memory at
/// `pointer` (its range's start or size); `Bypass` for the driver's own
/// answer, after the pod is back on its GPUs where the memory is backed.
pub(super) fn attribute(attribute: CUpointer_attribute, pointer: CUdeviceptr) -> Result<u64> {
    let (base, size) = backed_range(pointer)?;
    match attribute {
        CU_POINTER_ATTRIBUTE_RANGE_START_ADDR => Ok(base),
        CU_POINTER_ATTRIBUTE_RANGE_SIZE => Ok(size),
        _ => {
            if let Some(limiter) = entry::limiter() {
                limiter.resident();
            }
            Err(LimiterError::Bypass(Pass::DriverAnswers))
        }
    }
}
