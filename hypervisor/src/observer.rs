//! What the node's GPUs look like: NVML on a real node, a simulation in tests.

use std::sync::Mutex;

use serde::{Deserialize, Serialize};

/// One GPU of the node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// `GPU-…` UUID.
    pub uuid: String,
    pub name: String,
    pub memory_total: u64,
    pub memory_used: u64,
}

/// One process's recent use of one GPU, in percent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessUtilization {
    /// Host pid.
    pub pid: u32,
    pub sm_percent: u32,
    pub memory_percent: u32,
}

/// Device memory NVML attributes to one process on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ProcessMemory {
    /// Host pid.
    pub pid: u32,
    pub bytes: u64,
}

/// Why the GPUs could not be looked at.
#[derive(Debug, thiserror::Error)]
pub enum ObserverError {
    #[error("NVML: {0}")]
    Nvml(#[from] nvml_wrapper::error::NvmlError),
    #[error("GPU index {0} does not exist")]
    NoSuchGpu(u32),
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

    /// Device memory of each compute process on GPU `index`; processes whose
    /// figure NVML does not know are left out.
    fn process_memory(&self, index: u32) -> Result<Vec<ProcessMemory>, ObserverError> {
        let _ = index;
        Ok(Vec::new())
    }
}

/// NVML through `nvml-wrapper`, which loads `libnvidia-ml.so` at run time:
/// the binary builds and starts on machines without NVIDIA libraries, and
/// only this constructor fails there.
pub struct NvmlObserver {
    nvml: nvml_wrapper::Nvml,
    /// NVML timestamp of the last utilization sample seen, per GPU index.
    last_sample: Mutex<std::collections::HashMap<u32, u64>>,
}

impl NvmlObserver {
    /// Loads and initialises NVML.
    pub fn new() -> Result<Self, ObserverError> {
        Ok(Self {
            nvml: nvml_wrapper::Nvml::init()?,
            last_sample: Mutex::new(std::collections::HashMap::new()),
        })
    }
}

impl GpuObserver for NvmlObserver {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        let count = self.nvml.device_count()?;
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            let device = self.nvml.device_by_index(index)?;
            let memory = device.memory_info()?;
            gpus.push(GpuInfo {
                index,
                uuid: device.uuid()?,
                name: device.name().unwrap_or_default(),
                memory_total: memory.total,
                memory_used: memory.used,
            });
        }
        Ok(gpus)
    }

    fn process_utilization(&self, index: u32) -> Result<Vec<ProcessUtilization>, ObserverError> {
        let device = self.nvml.device_by_index(index)?;
        let since = self
            .last_sample
            .lock()
            .ok()
            .and_then(|seen| seen.get(&index).copied());
        let samples = match device.process_utilization_stats(since) {
            Ok(samples) => samples,
            // No process used the GPU since `since`, or the GPU cannot tell.
            Err(
                nvml_wrapper::error::NvmlError::NotFound
                | nvml_wrapper::error::NvmlError::NotSupported,
            ) => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        if let (Some(latest), Ok(mut seen)) = (
            samples.iter().map(|s| s.timestamp).max(),
            self.last_sample.lock(),
        ) {
            seen.insert(index, latest);
        }
        Ok(samples
            .into_iter()
            .map(|s| ProcessUtilization {
                pid: s.pid,
                sm_percent: s.sm_util,
                memory_percent: s.mem_util,
            })
            .collect())
    }

    fn process_memory(&self, index: u32) -> Result<Vec<ProcessMemory>, ObserverError> {
        let device = self.nvml.device_by_index(index)?;
        Ok(device
            .running_compute_processes()?
            .into_iter()
            .filter_map(|p| match p.used_gpu_memory {
                nvml_wrapper::enums::device::UsedGpuMemory::Used(bytes) => {
                    Some(ProcessMemory { pid: p.pid, bytes })
                }
                nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => None,
            })
            .collect())
    }
}

/// `--simulate-gpus N`: N GPUs of 80 GiB with made-up UUIDs
/// (`GPU-00000000-0000-4000-8000-00000000000<i>` in hex), for tests and demos.
pub struct SimulatedGpus {
    gpus: Mutex<Vec<GpuInfo>>,
    processes: Mutex<Vec<(u32, ProcessUtilization)>>,
    memory: Mutex<Vec<(u32, ProcessMemory)>>,
}

impl SimulatedGpus {
    /// GPU memory of each simulated GPU.
    pub const MEMORY: u64 = 80 << 30;

    pub fn new(count: u32) -> Self {
        let gpus = (0..count)
            .map(|index| GpuInfo {
                index,
                uuid: Self::uuid(index),
                name: "Simulated GPU".to_owned(),
                memory_total: Self::MEMORY,
                memory_used: 0,
            })
            .collect();
        Self {
            gpus: Mutex::new(gpus),
            processes: Mutex::new(Vec::new()),
            memory: Mutex::new(Vec::new()),
        }
    }

    /// Sets what GPU `index` reports of its processes.
    pub fn set_processes(&self, index: u32, samples: Vec<ProcessUtilization>) {
        if let Ok(mut processes) = self.processes.lock() {
            processes.retain(|(gpu, _)| *gpu != index);
            processes.extend(samples.into_iter().map(|s| (index, s)));
        }
    }

    /// Sets the memory GPU `index` attributes to its processes.
    pub fn set_process_memory(&self, index: u32, processes: Vec<ProcessMemory>) {
        if let Ok(mut memory) = self.memory.lock() {
            memory.retain(|(gpu, _)| *gpu != index);
            memory.extend(processes.into_iter().map(|p| (index, p)));
        }
    }

    /// The UUID of simulated GPU `index`.
    pub fn uuid(index: u32) -> String {
        format!("GPU-00000000-0000-4000-8000-{index:012x}")
    }

    /// Sets the memory GPU `index` reports as used.
    pub fn set_used(&self, index: u32, bytes: u64) -> Result<(), ObserverError> {
        let mut gpus = self
            .gpus
            .lock()
            .map_err(|_| ObserverError::NoSuchGpu(index))?;
        let gpu = gpus
            .iter_mut()
            .find(|g| g.index == index)
            .ok_or(ObserverError::NoSuchGpu(index))?;
        gpu.memory_used = bytes;
        Ok(())
    }
}

impl GpuObserver for SimulatedGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        Ok(self
            .gpus
            .lock()
            .map(|gpus| gpus.clone())
            .unwrap_or_default())
    }

    fn process_utilization(&self, index: u32) -> Result<Vec<ProcessUtilization>, ObserverError> {
        Ok(self
            .processes
            .lock()
            .map(|p| {
                p.iter()
                    .filter(|(gpu, _)| *gpu == index)
                    .map(|(_, s)| *s)
                    .collect()
            })
            .unwrap_or_default())
    }

    fn process_memory(&self, index: u32) -> Result<Vec<ProcessMemory>, ObserverError> {
        Ok(self
            .memory
            .lock()
            .map(|m| {
                m.iter()
                    .filter(|(gpu, _)| *gpu == index)
                    .map(|(_, p)| *p)
                    .collect()
            })
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_gpus_are_stable() {
        let sim = SimulatedGpus::new(2);
        let gpus = sim.gpus().unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].uuid, "GPU-00000000-0000-4000-8000-000000000001");
        sim.set_used(1, 5).unwrap();
        assert_eq!(sim.gpus().unwrap()[1].memory_used, 5);
        assert!(sim.set_used(7, 5).is_err());
        assert!(sim.process_utilization(0).unwrap().is_empty());
        let sample = ProcessUtilization {
            pid: 9,
            sm_percent: 40,
            memory_percent: 3,
        };
        sim.set_processes(1, vec![sample]);
        assert_eq!(sim.process_utilization(1).unwrap(), vec![sample]);
        assert!(sim.process_utilization(0).unwrap().is_empty());
    }

    #[test]
    fn nvml_fails_cleanly_without_the_library() {
        // On a machine without NVIDIA's library this is an error, not a crash;
        // on a GPU machine it lists the GPUs.
        match NvmlObserver::new() {
            Ok(nvml) => assert!(nvml.gpus().is_ok()),
            Err(e) => assert!(e.to_string().starts_with("NVML"), "{e}"),
        }
    }
}
