//! Budgets: which device a launch runs on and the compute bucket that pays
//! for it, per GPU, resolved once from the local configuration or looked up
//! on every launch under a hypervisor (whose limits change live).

use std::sync::OnceLock;

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::bucket::ComputeBucket;

use crate::config::{ComputeLimit, ComputePolicy, DeviceLimits};
use crate::context::Context;
use crate::driver::Driver;
use crate::error::{LimiterError, Pass, Result};

/// A device's compute limit, resolved.
#[derive(Clone, Copy)]
pub(super) struct DeviceBudget {
    pub(super) bucket: &'static ComputeBucket,
    /// The pod may run up to its ceiling while no other pod uses the device.
    pub(super) elastic: bool,
}

/// The pod's compute budgets on this process's devices.
pub(super) struct Budgets {
    configured: DeviceLimits<ComputeLimit>,
    /// The local limits, resolved at a device's first launch.
    resolved: [OnceLock<Option<DeviceBudget>>; MAX_DEVICES],
    /// Under a hypervisor, the bucket of each device this process launched
    /// on with a compute limit, for the exit summary.
    hypervised: [OnceLock<&'static ComputeBucket>; MAX_DEVICES],
    /// The process sees exactly one device.
    single_device: OnceLock<bool>,
}

impl Budgets {
    pub(super) fn new(configured: DeviceLimits<ComputeLimit>) -> Self {
        Self {
            configured,
            resolved: [const { OnceLock::new() }; MAX_DEVICES],
            hypervised: [const { OnceLock::new() }; MAX_DEVICES],
            single_device: OnceLock::new(),
        }
    }

    /// The compute limits the environment configured.
    pub(super) fn configured(&self) -> &DeviceLimits<ComputeLimit> {
        &self.configured
    }

    /// The device of the calling thread's launch. With one device visible,
    /// every context is on device 0: no driver call (a launch without a
    /// context fails in the driver, refunded).
    #[inline]
    pub(super) fn device(&self, driver: &Driver) -> Result<usize> {
        if *self
            .single_device
            .get_or_init(|| driver.device_count() == Some(1))
        {
            return Ok(0);
        }
        let device = driver
            .current_device()
            .map_err(|_| LimiterError::Bypass(Pass::NoCurrentContext))?;
        usize::try_from(device).map_err(|_| LimiterError::Bypass(Pass::BadDevice))
    }

    /// The budget of `device`, resolved once; `None` when it is unlimited.
    /// Under a hypervisor, the bucket whose limits it sets in the pod's
    /// read-only limits object, looked at on every launch: limits change live.
    #[inline]
    pub(super) fn get(
        &self,
        ctx: &'static Context,
        device: usize,
        hypervised: bool,
    ) -> Option<DeviceBudget> {
        if hypervised {
            let bucket = ctx.bucket(device)?;
            if !bucket.is_limited() {
                return None;
            }
            if let Some(seen) = self.hypervised.get(device)
                && seen.get().is_none()
            {
                seen.set(bucket).ok();
            }
            return Some(DeviceBudget {
                bucket,
                elastic: false,
            });
        }
        self.resolved
            .get(device)?
            .get_or_init(|| self.resolve(ctx, device))
            .as_ref()
            .copied()
    }

    /// The local limit of `device`, at its first launch.
    #[cold]
    fn resolve(&self, ctx: &'static Context, device: usize) -> Option<DeviceBudget> {
        let uuid = ctx.device_uuid(device);
        let limit = self.configured.resolve(device as u32, uuid.as_deref())?;
        if limit.policy == ComputePolicy::None {
            return None;
        }
        // Unusable ledger: already reported; launch unthrottled rather than
        // block the application for ever.
        let bucket = ctx.bucket(device)?;
        bucket.configure(limit.percent, limit.ceiling());
        tracing::debug!(device, ?uuid, ?limit, "compute limit resolved");
        Some(DeviceBudget {
            bucket,
            elastic: limit.policy == ComputePolicy::Elastic,
        })
    }

    /// The buckets this process launched against with a compute limit, by
    /// device: its local budgets, and those a hypervisor set.
    pub(super) fn used(&self) -> impl Iterator<Item = (usize, &'static ComputeBucket)> + '_ {
        let local = self.local().map(|(device, budget)| (device, budget.bucket));
        let hypervised = self
            .hypervised
            .iter()
            .enumerate()
            .filter_map(|(device, seen)| Some((device, *seen.get()?)));
        local.chain(hypervised)
    }

    /// The local budgets resolved so far, by device (none under a hypervisor).
    pub(super) fn local(&self) -> impl Iterator<Item = (usize, DeviceBudget)> + '_ {
        self.resolved
            .iter()
            .enumerate()
            .filter_map(|(device, budget)| Some((device, (*budget.get()?)?)))
    }
}
