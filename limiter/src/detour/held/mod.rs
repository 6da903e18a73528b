//! Memory the driver holds for the process without an allocation call:
//! context limits, module and library globals, graph allocation nodes and
//! what pools keep, charged to the pod like allocations.

mod hooks;
mod ops;

pub(crate) use hooks::{HELD_DETOURS, trim_unused};

/// The first launch of `handle` (a launch detour's check): see
/// [`ops::Held::first_launch`]; `driver_free`: the driver's own free memory
/// on the current device, told to the hypervisor when room is asked.
pub(crate) fn first_launch(
    handle: usize,
    driver_free: fn() -> Option<u64>,
) -> crate::error::Result<()> {
    ops::held()?.first_launch(handle, driver_free)
}
