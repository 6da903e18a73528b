//! The GPUs through NVML (`nvml-wrapper`, which loads `libnvidia-ml.so` at
//! run time), and a thread of its own that waits for NVML's health events.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use nvml_wrapper::Nvml;
use nvml_wrapper::bitmasks::event::EventTypes;
use nvml_wrapper::enum_wrappers::device::Sampling;
use nvml_wrapper::enums::device::SampleValue;
use nvml_wrapper::enums::event::XidError;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::event::EventSet;
use nvml_wrapper::struct_wrappers::event::EventData;

use super::health::{HealthBoard, HealthEvent, HealthPolicy};
use super::{GpuInfo, GpuObserver, ObserverError, ProcessMemory, ProcessUtilization};

/// How long one wait for events lasts: the longest a stop goes unseen.
const EVENT_WAIT_MS: u32 = 5_000;
/// Pause before registering again after the event set failed.
const RETRY: Duration = Duration::from_secs(10);

/// NVML: the binary builds and starts on machines without NVIDIA libraries,
/// and only this constructor fails there.
pub struct NvmlObserver {
    nvml: Arc<Nvml>,
    /// NVML timestamp of the last utilization sample seen, per GPU index.
    last_sample: Mutex<HashMap<u32, u64>>,
    /// NVML timestamp of the last GPU busy sample seen, per GPU index.
    last_busy: Mutex<HashMap<u32, u64>>,
    health: Arc<HealthBoard>,
    /// Every GPU seen, by UUID, as last seen: a lost GPU is listed so.
    known: Mutex<BTreeMap<String, GpuInfo>>,
    /// Tells the event thread to end (it notices within [`EVENT_WAIT_MS`]).
    stop: Arc<AtomicBool>,
}

impl NvmlObserver {
    /// Loads and initialises NVML, with the default health policy.
    pub fn new() -> Result<Self, ObserverError> {
        Self::with_health(HealthPolicy::default())
    }

    /// Loads and initialises NVML; unless `policy` is off, a thread waits
    /// for critical XIDs and ECC errors.
    pub fn with_health(policy: HealthPolicy) -> Result<Self, ObserverError> {
        let observer = Self {
            nvml: Arc::new(Nvml::init()?),
            last_sample: Mutex::new(HashMap::new()),
            last_busy: Mutex::new(HashMap::new()),
            health: Arc::new(HealthBoard::new(policy)),
            known: Mutex::new(BTreeMap::new()),
            stop: Arc::new(AtomicBool::new(false)),
        };
        if observer.health.policy().enabled {
            let (nvml, board, stop) = (
                Arc::clone(&observer.nvml),
                Arc::clone(&observer.health),
                Arc::clone(&observer.stop),
            );
            std::thread::Builder::new()
                .name("nvml-events".to_owned())
                .spawn(move || watch_events(&nvml, &board, &stop))
                .map_err(ObserverError::Thread)?;
        }
        Ok(observer)
    }

    fn read(&self, index: u32) -> Result<GpuInfo, NvmlError> {
        let device = self.nvml.device_by_index(index)?;
        let memory = device.memory_info()?;
        Ok(GpuInfo {
            index,
            uuid: device.uuid()?,
            name: device.name().unwrap_or_default(),
            memory_total: memory.total,
            memory_used: memory.used,
        })
    }
}

impl Drop for NvmlObserver {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

impl GpuObserver for NvmlObserver {
    /// The GPUs that answer, and those that answer `GPU_IS_LOST` as last
    /// seen (marked lost); a GPU that no longer enumerates is marked lost
    /// and left out.
    fn gpus(&self) -> Result<Vec<GpuInfo>, ObserverError> {
        let count = self.nvml.device_count()?;
        let mut known = self.known.lock().unwrap_or_else(PoisonError::into_inner);
        let mut gpus = Vec::with_capacity(count as usize);
        for index in 0..count {
            match self.read(index) {
                Ok(gpu) => {
                    self.health.record(&gpu.uuid, HealthEvent::Found);
                    known.insert(gpu.uuid.clone(), gpu.clone());
                    gpus.push(gpu);
                }
                Err(NvmlError::GpuLost) => {
                    match known.values().find(|g| g.index == index) {
                        Some(gpu) => {
                            self.health.record(&gpu.uuid, HealthEvent::Lost);
                            gpus.push(gpu.clone());
                        }
                        // Never seen: nothing to publish it as.
                        None => tracing::warn!(index, "a GPU never seen before is lost"),
                    }
                }
                Err(error) => return Err(error.into()),
            }
        }
        for uuid in known.keys() {
            if !gpus.iter().any(|g| g.uuid == *uuid) {
                self.health.record(uuid, HealthEvent::Lost);
            }
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
            Err(NvmlError::NotFound | NvmlError::NotSupported) => return Ok(Vec::new()),
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

    /// From the GPU's utilization samples (NVML keeps the last few
    /// seconds'): the mean of those newer than the last call's, or, at the
    /// first call, the newest alone.
    fn busy_percent(&self, index: u32) -> Result<Option<u32>, ObserverError> {
        let device = self.nvml.device_by_index(index)?;
        let mut seen = self
            .last_busy
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let since = seen.get(&index).copied();
        let samples = match device.samples(Sampling::GpuUtilization, since) {
            Ok(samples) => samples,
            // No sample since `since`, or the GPU cannot tell.
            Err(NvmlError::NotFound | NvmlError::NotSupported) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let newest = samples.iter().map(|s| s.timestamp).max();
        let values: Vec<u64> = samples
            .iter()
            .filter(|s| match since {
                Some(seen) => s.timestamp > seen,
                None => Some(s.timestamp) == newest,
            })
            .filter_map(|s| match s.value {
                SampleValue::U32(v) => Some(u64::from(v)),
                SampleValue::U64(v) => Some(v),
                _ => None,
            })
            .collect();
        if let Some(newest) = newest {
            seen.insert(index, newest);
        }
        let count = values.len() as u64;
        Ok((count > 0).then(|| (values.iter().sum::<u64>() / count).min(100) as u32))
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

    fn health(&self) -> Option<&HealthBoard> {
        Some(&self.health)
    }
}

/// The event types asked for, where a GPU supports them.
fn wanted() -> EventTypes {
    EventTypes::CRITICAL_XID_ERROR
        | EventTypes::SINGLE_BIT_ECC_ERROR
        | EventTypes::DOUBLE_BIT_ECC_ERROR
}

/// The event thread: registers every GPU, waits for events until `stop`,
/// and registers again (after [`RETRY`]) when the set fails.
fn watch_events(nvml: &Nvml, board: &HealthBoard, stop: &AtomicBool) {
    while !stop.load(Ordering::Relaxed) {
        let (set, uuids) = match register(nvml) {
            Ok(Some(registered)) => registered,
            Ok(None) => {
                tracing::warn!(
                    "no GPU reports XID or ECC events: health is only whether GPUs answer"
                );
                return;
            }
            Err(error) => {
                tracing::warn!(%error, "NVML events not registered; retrying");
                std::thread::sleep(RETRY);
                continue;
            }
        };
        tracing::info!(gpus = uuids.len(), "waiting for NVML XID and ECC events");
        while !stop.load(Ordering::Relaxed) {
            match set.wait(EVENT_WAIT_MS) {
                Ok(event) => on_event(board, &uuids, &event),
                Err(NvmlError::Timeout) => {}
                Err(error) => {
                    // A lost GPU is found by the next look at the GPUs.
                    tracing::warn!(%error, "waiting for NVML events failed; registering again");
                    std::thread::sleep(RETRY);
                    break;
                }
            }
        }
    }
}

/// An event set with every GPU that supports some of [`wanted`], and their
/// UUIDs; `None` when none does. A GPU whose registration fails is left
/// out (NVML frees the set then: it is built again without it).
fn register(nvml: &Nvml) -> Result<Option<(EventSet<'_>, Vec<String>)>, NvmlError> {
    let count = nvml.device_count()?;
    let mut skip = Vec::new();
    'build: loop {
        let mut set = nvml.create_event_set()?;
        let mut uuids = Vec::new();
        for index in (0..count).filter(|i| !skip.contains(i)) {
            let found = nvml.device_by_index(index).and_then(|d| Ok((d.uuid()?, d)));
            let (uuid, device) = match found {
                Ok(found) => found,
                // Lost already: the look at the GPUs marks it.
                Err(error) => {
                    tracing::warn!(index, %error, "NVML events not registered for the GPU");
                    continue;
                }
            };
            let types = match device.supported_event_types() {
                Ok(types) => types & wanted(),
                Err(NvmlError::NotSupported) => EventTypes::empty(),
                Err(error) => return Err(error),
            };
            if types.is_empty() {
                tracing::info!(gpu = uuid, "the GPU reports no XID or ECC events");
                continue;
            }
            set = match device.register_events(types, set) {
                Ok(set) => set,
                Err(error) => {
                    tracing::warn!(gpu = uuid, error = %error.error, "NVML events not registered for the GPU");
                    skip.push(index);
                    continue 'build;
                }
            };
            uuids.push(uuid);
        }
        return Ok((!uuids.is_empty()).then_some((set, uuids)));
    }
}

/// Records `event` on its GPU; on every GPU of `uuids` when NVML does not
/// say which (as NVIDIA's device plugin does).
fn on_event(board: &HealthBoard, uuids: &[String], event: &EventData<'_>) {
    let what = if event.event_type.contains(EventTypes::CRITICAL_XID_ERROR) {
        HealthEvent::Xid(match event.event_data {
            Some(XidError::Value(xid)) => Some(xid),
            Some(XidError::Unknown) | None => None,
        })
    } else if event.event_type.contains(EventTypes::DOUBLE_BIT_ECC_ERROR) {
        HealthEvent::EccUncorrected
    } else if event.event_type.contains(EventTypes::SINGLE_BIT_ECC_ERROR) {
        HealthEvent::EccCorrected
    } else {
        return;
    };
    match event.device.uuid() {
        Ok(uuid) => {
            board.record(&uuid, what);
        }
        Err(error) => {
            tracing::warn!(%error, event = ?what, "NVML event of an unknown GPU: every GPU marked");
            for uuid in uuids {
                board.record(uuid, what);
            }
        }
    }
}
