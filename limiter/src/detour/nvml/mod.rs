//! NVML: the memory reports `nvidia-smi` and monitoring agents read.

mod hooks;
mod ops;

pub use hooks::NVML_DETOURS;
