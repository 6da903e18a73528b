//! `--simulate-gpus N`: GPUs made up, for trying the daemon (and its
//! Kubernetes agent) on a machine without NVIDIA's driver. They are always
//! healthy and idle; tests that need GPUs whose state changes use a double.

use super::health::{HealthBoard, HealthPolicy};
use super::{GpuInfo, GpuObserver, ObserverError};

/// `--simulate-gpus N`: N GPUs of 80 GiB with made-up UUIDs
/// (`GPU-00000000-0000-4000-8000-00000000000<i>` in hex).
pub struct SimulatedGpus {
    gpus: Vec<GpuInfo>,
    health: HealthBoard,
}

impl SimulatedGpus {
    /// GPU memory of each simulated GPU.
    pub const MEMORY: u64 = 80 << 30;

    /// `count` GPUs.
    pub fn new(count: u32) -> Self {
        Self::with_health(count, HealthPolicy::default())
    }

    /// `count` GPUs, their (empty) health board under `policy`.
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
            gpus,
            health: HealthBoard::new(policy),
        }
    }

    /// The UUID of simulated GPU `index`.
    pub fn uuid(index: u32) -> String {
        format!("GPU-00000000-0000-4000-8000-{index:012x}")
    }
}

impl GpuObserver for SimulatedGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        Ok(self.gpus.clone())
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
    fn simulated_gpus_are_stable_healthy_and_idle() {
        let sim = SimulatedGpus::new(2);
        let gpus = sim.gpus().unwrap();
        assert_eq!(gpus.len(), 2);
        assert_eq!(gpus[1].uuid, "GPU-00000000-0000-4000-8000-000000000001");
        assert!(gpus.iter().all(|g| g.memory_used == 0));
        assert!(sim.process_utilization(0).unwrap().is_empty());
        assert!(sim.process_memory(1).unwrap().is_empty());
        assert!(sim.health().unwrap().unhealthy().is_empty());
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
