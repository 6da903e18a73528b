//! What the node's GPUs look like: NVML on a real node ([`nvml`]), a
//! simulation in tests ([`simulated`]), and whether they are healthy
//! ([`health`]).

pub mod clock;
pub mod flags;
pub mod health;
pub mod nvml;
pub mod simulated;

use serde::{Deserialize, Serialize};

pub use health::{Fault, HealthBoard, HealthEvent, HealthPolicy, Unhealthy};
pub use nvml::NvmlObserver;
pub use simulated::SimulatedGpus;

/// One GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Product name as NVML reports it (`NVIDIA H100 80GB HBM3`); empty where
    /// NVML would not say.
    pub name: String,
    /// Device memory, in bytes.
    pub memory_total: u64,
    /// Device memory in use on the GPU when it was read (every process's and
    /// the driver's), in bytes.
    pub memory_used: u64,
}

impl GpuInfo {
    /// The GPU of `gpus` that `named` names, as a flag or a command does:
    /// its index, or its UUID in any case.
    pub fn find<'a>(gpus: &'a [GpuInfo], named: &str) -> Option<&'a GpuInfo> {
        match named.parse::<u32>() {
            Ok(index) => gpus.iter().find(|g| g.index == index),
            Err(_) => gpus.iter().find(|g| g.uuid.eq_ignore_ascii_case(named)),
        }
    }
}

/// One process's recent use of one GPU, in percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessUtilization {
    /// Host pid.
    pub pid: u32,
    /// Share of the sample period in which the process had a kernel running
    /// on the SMs, 0 to 100.
    pub sm_percent: u32,
    /// Share of the sample period in which the process read or wrote device
    /// memory, 0 to 100.
    pub memory_percent: u32,
}

/// Device memory NVML attributes to one process on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// Host pid.
    pub pid: u32,
    /// Device memory the process holds, in bytes.
    pub bytes: u64,
}

/// Why the GPUs could not be looked at.
#[derive(Debug, thiserror::Error)]
pub enum ObserverError {
    /// An NVML call failed (not loaded, no permission, driver error).
    #[error("NVML: {0}")]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
    /// No GPU has this NVML index (any longer).
    #[error("GPU index {0} does not exist")]
    NoSuchGpu(u32),
    /// The thread that waits for XID and ECC events could not be spawned,
    /// so health could not be watched.
    #[error("cannot start the NVML event thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Looks at the node's GPUs. Calls may block for milliseconds (NVML): the
/// daemon makes them off its async threads.
pub trait GpuObserver: Send + Sync {
    /// All GPUs, by index.
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError>;

    /// Per-process utilization of GPU `index` since the last call, where the
    /// GPU reports it; empty where it does not.
    fn process_utilization(&self, index: u32) -> Result<Vec<ProcessUtilization>, ObserverError> {
        let _ = index;
        Ok(Vec::new())
    }

    /// The share of the time, in percent, in which a kernel ran on GPU
    /// `index`, over the samples the GPU took since the last call (their
    /// mean); `None` when it took none since, or does not say.
    fn busy_percent(&self, index: u32) -> Result<Option<u32>, ObserverError> {
        let _ = index;
        Ok(None)
    }

    /// Device memory of each compute process on GPU `index`; processes whose
    /// figure NVML does not know are left out.
    fn process_memory(&self, index: u32) -> Result<Vec<ProcessMemory>, ObserverError> {
        let _ = index;
        Ok(Vec::new())
    }

    /// The GPUs' health, where it is watched.
    fn health(&self) -> Option<&HealthBoard> {
        None
    }
}
