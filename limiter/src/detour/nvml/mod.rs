//! NVML: the memory reports `nvidia-smi` and monitoring agents read.

mod hooks;
mod ops;

pub(crate) use hooks::{NVML_DETOURS, gpu_free};
