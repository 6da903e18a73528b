//! `--simulate-gpus N`: GPUs made up for tests and demos, whose health
//! events are injected.

use std::sync::Mutex;

use super::health::{HealthBoard, HealthEvent, HealthPolicy};
use super::{GpuInfo, GpuObserver, ObserverError, ProcessMemory, ProcessUtilization};

/// `--simulate-gpus N`: N GPUs of 80 GiB with made-up UUIDs
/// (`GPU-00000000-0000-4000-8000-00000000000<i>` in hex), for tests and demos.
pub struct SimulatedGpus {
    gpus: Mutex<Vec<GpuInfo>>,
    processes: Mutex<Vec<(u32, ProcessUtilization)>>,
    memory: Mutex<Vec<(u32, ProcessMemory)>>,
    health: HealthBoard,
}

impl SimulatedGpus {
    /// GPU memory of each simulated GPU.
    pub const MEMORY: u64 = 80 << 30;

    pub fn new(count: u32) -> Self {
        Self::with_health(count, HealthPolicy::default())
    }

    /// `count` GPUs whose injected health events count under `policy`.
    pub fn with_health(count: u32, policy: HealthPolicy) -> Self {
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
            health: HealthBoard::new(policy),
        }
    }

    /// Records `event` on GPU `index` as NVML would report it (an XID on the
    /// ignore list changes nothing); returns whether its health changed.
    pub fn inject(&self, index: u32, event: HealthEvent) -> Result<bool, ObserverError> {
        Ok(self.health.record(&self.uuid_of(index)?, event))
    }

    /// Forgets GPU `index`'s faults, as a reset and a restart of the daemon would.
    pub fn clear_health(&self, index: u32) -> Result<bool, ObserverError> {
        Ok(self.health.clear(&self.uuid_of(index)?))
    }

    fn uuid_of(&self, index: u32) -> Result<String, ObserverError> {
        self.gpus
            .lock()
            .map_err(|_| ObserverError::NoSuchGpu(index))?
            .iter()
            .find(|g| g.index == index)
            .map(|g| g.uuid.clone())
            .ok_or(ObserverError::NoSuchGpu(index))
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

    fn health(&self) -> Option<&HealthBoard> {
        Some(&self.health)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NvmlObserver;

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
    fn injected_health_follows_the_policy() {
        let sim = SimulatedGpus::new(2);
        let board = sim.health().unwrap();
        assert!(!sim.inject(1, HealthEvent::Xid(Some(13))).unwrap());
        assert!(sim.inject(1, HealthEvent::Xid(Some(79))).unwrap());
        assert!(sim.inject(7, HealthEvent::Lost).is_err());
        let unhealthy = board.unhealthy();
        assert_eq!(
            unhealthy.keys().collect::<Vec<_>>(),
            [&SimulatedGpus::uuid(1)]
        );
        assert!(sim.clear_health(1).unwrap());
        assert!(board.unhealthy().is_empty());
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
