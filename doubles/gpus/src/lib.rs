//! [`FakeGpus`]: the node's GPUs as a test sets them. The daemon sees them
//! through its observer trait, as it sees NVML: a test injects the health
//! events NVML would report, and sets what each GPU says of its processes
//! and of its memory in use. A dev-only crate: the daemon never links it.

use std::sync::Mutex;

use hypervisor_observer::{
    GpuInfo, GpuObserver, HealthBoard, HealthEvent, HealthPolicy, ObserverError, ProcessMemory,
    ProcessUtilization, SimulatedGpus,
};

/// What a GPU reports at each look, read from elsewhere (a driver
/// double's files): by the GPU's index.
type Source<T> = Box<dyn Fn(u32) -> T + Send + Sync>;

/// GPUs whose health, processes and memory in use the test sets, or has
/// read from a source at every look.
pub struct FakeGpus {
    gpus: Mutex<Vec<GpuInfo>>,
    processes: Mutex<Vec<(u32, ProcessUtilization)>>,
    memory: Mutex<Vec<(u32, ProcessMemory)>>,
    busy: Mutex<Vec<(u32, u32)>>,
    health: HealthBoard,
    memory_from: Option<Source<Vec<ProcessMemory>>>,
    used_from: Option<Source<Option<u64>>>,
}

impl FakeGpus {
    /// `count` GPUs, health events counted under the default policy.
    pub fn new(count: u32) -> Self {
        Self::with_health(count, HealthPolicy::default())
    }

    /// `count` GPUs whose injected health events count under `policy`.
    pub fn with_health(count: u32, policy: HealthPolicy) -> Self {
        let gpus = SimulatedGpus::new(count).gpus().unwrap_or_default();
        Self::from_gpus(gpus, policy)
    }

    /// `gpus` as they are described, health events counted under `policy`.
    pub fn from_gpus(gpus: Vec<GpuInfo>, policy: HealthPolicy) -> Self {
        Self {
            gpus: Mutex::new(gpus),
            processes: Mutex::new(Vec::new()),
            memory: Mutex::new(Vec::new()),
            busy: Mutex::new(Vec::new()),
            health: HealthBoard::new(policy),
            memory_from: None,
            used_from: None,
        }
    }

    /// The memory each GPU attributes to its processes read from `source`
    /// at every look, instead of what [`FakeGpus::set_process_memory`] set.
    pub fn process_memory_from(
        mut self,
        source: impl Fn(u32) -> Vec<ProcessMemory> + Send + Sync + 'static,
    ) -> Self {
        self.memory_from = Some(Box::new(source));
        self
    }

    /// The memory each GPU reports in use read from `source` at every look
    /// (`None`: what [`FakeGpus::set_used`] set).
    pub fn memory_used_from(
        mut self,
        source: impl Fn(u32) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.used_from = Some(Box::new(source));
        self
    }

    /// The UUID of GPU `index`.
    pub fn uuid(index: u32) -> String {
        SimulatedGpus::uuid(index)
    }

    /// Records `event` on GPU `index` as NVML would report it (an XID on the
    /// ignore list changes nothing); returns whether its health changed.
    pub fn inject(&self, index: u32, event: HealthEvent) -> Result<bool, ObserverError> {
        Ok(self.health.record(&self.uuid_of(index)?, event))
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

    /// Sets the share of the time GPU `index` reports a kernel ran, in
    /// percent, at every later look; `None`: it reports none.
    pub fn set_busy(&self, index: u32, percent: Option<u32>) {
        if let Ok(mut busy) = self.busy.lock() {
            busy.retain(|(gpu, _)| *gpu != index);
            busy.extend(percent.map(|p| (index, p)));
        }
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

    fn uuid_of(&self, index: u32) -> Result<String, ObserverError> {
        self.gpus
            .lock()
            .map_err(|_| ObserverError::NoSuchGpu(index))?
            .iter()
            .find(|g| g.index == index)
            .map(|g| g.uuid.clone())
            .ok_or(ObserverError::NoSuchGpu(index))
    }
}

/// What GPU `index` reports of its processes, from `per_gpu`.
fn of_gpu<T: Copy>(per_gpu: &Mutex<Vec<(u32, T)>>, index: u32) -> Vec<T> {
    per_gpu
        .lock()
        .map(|all| {
            all.iter()
                .filter(|(gpu, _)| *gpu == index)
                .map(|(_, item)| *item)
                .collect()
        })
        .unwrap_or_default()
}

impl GpuObserver for FakeGpus {
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        let mut gpus = self
            .gpus
            .lock()
            .map(|gpus| gpus.clone())
            .unwrap_or_default();
        if let Some(used) = &self.used_from {
            for gpu in &mut gpus {
                gpu.memory_used = used(gpu.index).unwrap_or(gpu.memory_used);
            }
        }
        Ok(gpus)
    }

    fn process_utilization(&self, index: u32) -> Result<Vec<ProcessUtilization>, ObserverError> {
        Ok(of_gpu(&self.processes, index))
    }

    fn process_memory(&self, index: u32) -> Result<Vec<ProcessMemory>, ObserverError> {
        Ok(match &self.memory_from {
            Some(source) => source(index),
            None => of_gpu(&self.memory, index),
        })
    }

    fn busy_percent(&self, index: u32) -> Result<Option<u32>, ObserverError> {
        Ok(of_gpu(&self.busy, index).first().copied())
    }

    fn health(&self) -> Option<&HealthBoard> {
        Some(&self.health)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_the_test_sets_is_what_the_observer_sees() {
        let gpus = FakeGpus::new(2);
        assert_eq!(gpus.gpus().unwrap()[1].uuid, FakeGpus::uuid(1));
        gpus.set_used(1, 5).unwrap();
        assert_eq!(gpus.gpus().unwrap()[1].memory_used, 5);
        assert!(gpus.set_used(7, 5).is_err());
        let sample = ProcessUtilization {
            pid: 9,
            sm_percent: 40,
            memory_percent: 3,
        };
        gpus.set_processes(1, vec![sample]);
        assert_eq!(gpus.process_utilization(1).unwrap(), vec![sample]);
        assert!(gpus.process_utilization(0).unwrap().is_empty());
        let held = ProcessMemory { pid: 9, bytes: 7 };
        gpus.set_process_memory(0, vec![held]);
        assert_eq!(gpus.process_memory(0).unwrap(), vec![held]);
        assert!(gpus.process_memory(1).unwrap().is_empty());
        assert_eq!(gpus.busy_percent(0).unwrap(), None);
        gpus.set_busy(0, Some(88));
        assert_eq!(gpus.busy_percent(0).unwrap(), Some(88));
        assert_eq!(gpus.busy_percent(1).unwrap(), None);
    }

    #[test]
    fn what_a_source_reports_is_read_at_every_look() {
        let gpus = FakeGpus::new(2)
            .process_memory_from(|index| {
                vec![ProcessMemory {
                    pid: 9,
                    bytes: u64::from(index) + 1,
                }]
            })
            .memory_used_from(|index| (index == 1).then_some(42));
        gpus.set_used(0, 5).unwrap();
        assert_eq!(gpus.process_memory(1).unwrap()[0].bytes, 2);
        let seen = gpus.gpus().unwrap();
        assert_eq!((seen[0].memory_used, seen[1].memory_used), (5, 42));
    }

    #[test]
    fn injected_health_follows_the_policy() {
        let gpus = FakeGpus::new(2);
        let board = gpus.health().unwrap();
        assert!(!gpus.inject(1, HealthEvent::Xid(Some(13))).unwrap());
        assert!(gpus.inject(1, HealthEvent::Xid(Some(79))).unwrap());
        assert!(gpus.inject(7, HealthEvent::Lost).is_err());
        assert_eq!(
            board.unhealthy().keys().collect::<Vec<_>>(),
            [&FakeGpus::uuid(1)]
        );
    }
}
