//! Memory the driver holds for the process without an allocation call:
//! context limits, module and library globals, graph allocation nodes and
//! what pools keep, charged to the pod like allocations.

mod hooks;
mod ops;

pub use hooks::HELD_DETOURS;
