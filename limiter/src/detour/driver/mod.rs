//! Driver lifecycle: refusing CUDA when the configuration is broken.

mod hooks;
mod ops;

pub(crate) use hooks::DRIVER_DETOURS;
