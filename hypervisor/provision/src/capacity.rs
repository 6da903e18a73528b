//! The provisioner's own count of each GPU: what the prepared claims hold,
//! and the check of a new claim against what is left.

use crate::{ClaimRequest, DeviceGrant, ProvisionError, Provisioner};

impl Provisioner {
    /// Memory (bytes) and compute (percent) the prepared claims hold of GPU `uuid`.
    pub fn held(&self, uuid: &str) -> (u64, u32) {
        self.checkpoint
            .claims
            .values()
            .flat_map(|c| &c.request.devices)
            .filter(|d| d.gpu_uuid == uuid)
            .fold((0u64, 0u32), |(memory, compute), d| {
                (
                    memory.saturating_add(d.memory_bytes),
                    compute + u32::from(d.compute_percent),
                )
            })
    }

    /// Refuses `request` where a GPU it names has less memory or compute
    /// free than it asks, or where the pod's part of a GPU would pass the
    /// GPU's own memory.
    pub(super) fn check_capacity(&self, request: &ClaimRequest) -> Result<(), ProvisionError> {
        for (i, device) in request.devices.iter().enumerate() {
            let gpu = self.gpu(&device.gpu_uuid)?;
            // The other claims' parts of this GPU, and this claim's own
            // earlier ones (two of its requests may share one GPU).
            let held = |f: fn(&DeviceGrant) -> u64| -> u64 {
                self.checkpoint
                    .claims
                    .values()
                    .flat_map(|c| &c.request.devices)
                    .chain(&request.devices[..i])
                    .filter(|d| d.gpu_uuid == device.gpu_uuid)
                    .map(f)
                    .sum()
            };
            let check = |what, asked: u64, total: u64, held: u64| {
                let free = total.saturating_sub(held);
                if asked > free {
                    return Err(ProvisionError::OverCapacity {
                        gpu: gpu.uuid.clone(),
                        what,
                        asked,
                        free,
                        total,
                    });
                }
                Ok(())
            };
            check(
                "memory",
                device.memory_bytes,
                self.memory_capacity(gpu),
                held(|d| d.memory_bytes),
            )?;
            // The pod's own part of the GPU, this claim's included, is its
            // quota there: never past the GPU's memory, overcommit or not.
            let pod_held: u64 = self
                .checkpoint
                .claims
                .values()
                .filter(|c| c.request.pod.uid == request.pod.uid)
                .flat_map(|c| &c.request.devices)
                .chain(&request.devices[..=i])
                .filter(|d| d.gpu_uuid == device.gpu_uuid)
                .map(|d| d.memory_bytes)
                .fold(0, u64::saturating_add);
            if pod_held > gpu.memory_total {
                return Err(ProvisionError::PastTheGpu {
                    gpu: gpu.uuid.clone(),
                    pod: request.pod.to_string(),
                    asked: pod_held,
                    memory: gpu.memory_total,
                });
            }
            check(
                "compute",
                u64::from(device.compute_percent),
                100,
                held(|d| u64::from(d.compute_percent)),
            )?;
        }
        Ok(())
    }
}
