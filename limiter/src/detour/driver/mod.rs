//! Driver lifecycle: refusing CUDA when the configuration is broken.

mod hooks;
mod ops;

pub use hooks::DRIVER_DETOURS;
