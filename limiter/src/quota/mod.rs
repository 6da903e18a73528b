//! Memory quota accounting for this process's pod.
//!
//! Rules (also in docs/memory.md):
//! - Every allocation reserves its size in the pod's shared ledger *before*
//!   the driver allocates, so concurrent threads and processes cannot
//!   overshoot; a failed allocation gives the reservation back.
//! - Frees credit exactly what their allocation reserved.
//! - Memory the driver takes for itself (contexts, modules, rounding) comes
//!   through no allocation call. It is charged as this process's *overhead*
//!   on the device: what NVML attributes to the process minus what its
//!   allocations account for, measured at the first allocation or memory
//!   query on the device and again at most every [`OVERHEAD_REFRESH_MS`].
//!   So the pod's footprint as `nvidia-smi` shows it stays within the quota,
//!   except for driver memory taken since the last measurement. While one of
//!   this process's allocations or frees is between the ledger and the driver,
//!   the two disagree by its bytes, always on the low side: a measurement
//!   that overlapped one may only raise the overhead, and the next call
//!   with none under way measures again.
//! - A memory pool is charged what the driver says it reserves, freed
//!   memory it keeps included, not its allocations (see `pools`).
//! - Memory the driver takes for the process through calls that name no
//!   size (context limits, modules, graph allocation nodes: see
//!   `detour::held`) is reserved before the call where its size is known,
//!   measured right after it, and counted as *pending* while the driver has
//!   not taken it yet (the malloc heap until the next launch, graph nodes
//!   until upload), so that no measurement in between forgets it.
//! - Reports show total = quota, free = quota − pod usage, never below zero
//!   and never above what the device really has free. Before answering, the
//!   pod's dead processes' charges are given back (at most every
//!   [`REPORT_RECLAIM_MS`] per process), so a report right after a process
//!   died is right.
//! - Quotas and usage follow the GPU's UUID, not the index this process sees
//!   it at. Under a hypervisor the quota is the one in its read-only limits.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::ledger::{LedgerError, PodLedger};

use crate::config::DeviceLimits;
use crate::context::Context;
use crate::error::{LimiterError, Pass, Result};
use crate::grant::Grant;
use crate::sys::CUdevice;

mod held;
mod lazy;
mod measure;
mod pools;
mod report;

pub(crate) use lazy::{FirstUse, LazyLibraries};

pub(crate) use held::raise_overhead;
pub(crate) use report::virtual_report;

/// How often a device's driver overhead is measured again, at most.
pub(crate) const OVERHEAD_REFRESH_MS: u64 = 200;
/// How often a memory report scans for dead processes first, at most.
pub(crate) const REPORT_RECLAIM_MS: u64 = 100;

/// A driver object whose memory is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Resource {
    /// Linear memory (`cuMemAlloc*`), by device pointer.
    Pointer(u64),
    /// A VMM physical allocation (`cuMemCreate`), by handle.
    Handle(u64),
    /// A CUDA array, by handle.
    Array(usize),
    /// A mipmapped array, by handle.
    Mipmap(usize),
    /// A graph exec, whose allocation nodes are charged.
    GraphExec(usize),
}

/// What an allocation charged, and where.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Charge {
    /// The pod ledger's entry of the GPU (not the CUDA ordinal).
    pub device: usize,
    pub bytes: u64,
}

/// This process's allocations and frees under way between the ledger and
/// the driver, and how many ended: a measurement of the overhead that saw
/// the same count before and after, none under way, overlapped none.
#[derive(Default)]
struct Changes {
    under_way: AtomicU64,
    ended: AtomicU64,
}

impl Changes {
    fn snapshot(&self) -> (u64, u64) {
        (
            self.under_way.load(Ordering::SeqCst),
            self.ended.load(Ordering::SeqCst),
        )
    }
}

/// One allocation or free under way, from before the ledger changes until
/// both the ledger and the driver did.
pub(crate) struct Change<'a>(&'a Changes);

impl<'a> Change<'a> {
    fn begin(changes: &'a Changes) -> Self {
        changes.under_way.fetch_add(1, Ordering::SeqCst);
        Change(changes)
    }
}

impl Drop for Change<'_> {
    fn drop(&mut self) {
        self.0.ended.fetch_add(1, Ordering::SeqCst);
        self.0.under_way.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A graph exec's charge: `(device, bytes, bytes reserved for it)` a device.
type GraphParts = Vec<(usize, u64, u64)>;

/// The quota state of this process.
pub(crate) struct MemoryQuota {
    configured: DeviceLimits<u64>,
    limits: [OnceLock<Option<u64>>; MAX_DEVICES],
    charges: Mutex<HashMap<Resource, Charge>>,
    changes: Changes,
    overhead_measured_ms: [AtomicU64; MAX_DEVICES],
    /// The last measurement overlapped a change: measure again when none is
    /// under way.
    overhead_unsettled: [AtomicBool; MAX_DEVICES],
    /// Monotonic ms + 1 of this process's last report-time scan; 0: never.
    reclaimed_ms: AtomicU64,
    /// Heap growth reserved and not yet in the process's footprint, and
    /// the footprint it will show on top of.
    pending: [AtomicU64; MAX_DEVICES],
    pending_base: [AtomicU64; MAX_DEVICES],
    /// What live graph execs' allocation nodes take on each device, and
    /// each exec's part: `(device, bytes, bytes reserved for it)`.
    graph_need: [AtomicU64; MAX_DEVICES],
    graph_execs: Mutex<HashMap<Resource, GraphParts>>,
    /// The pools this process allocates from, charged what they reserve.
    pools: Mutex<pools::Pools>,
    /// What this process's contexts were measured at when made: the
    /// overhead never counts less while they live, even where allocations
    /// charged in full are not resident yet (managed memory).
    context_floor: [AtomicU64; MAX_DEVICES],
    /// Libraries loaded at their first use in a context.
    pub lazy: LazyLibraries,
    /// `CUDA_MODULE_LOADING=EAGER`: libraries are loaded into contexts by
    /// the calls that load them, not at their first use.
    pub eager_loading: bool,
}

impl MemoryQuota {
    pub(crate) fn new(configured: DeviceLimits<u64>) -> Self {
        Self {
            configured,
            limits: [const { OnceLock::new() }; MAX_DEVICES],
            charges: Mutex::new(HashMap::new()),
            changes: Changes::default(),
            overhead_measured_ms: [const { AtomicU64::new(0) }; MAX_DEVICES],
            overhead_unsettled: [const { AtomicBool::new(false) }; MAX_DEVICES],
            reclaimed_ms: AtomicU64::new(0),
            pending: [const { AtomicU64::new(0) }; MAX_DEVICES],
            pending_base: [const { AtomicU64::new(0) }; MAX_DEVICES],
            graph_need: [const { AtomicU64::new(0) }; MAX_DEVICES],
            graph_execs: Mutex::new(HashMap::new()),
            pools: Mutex::new(pools::Pools::default()),
            context_floor: [const { AtomicU64::new(0) }; MAX_DEVICES],
            lazy: LazyLibraries::default(),
            eager_loading: std::env::var_os("CUDA_MODULE_LOADING")
                .is_some_and(|mode| mode.eq_ignore_ascii_case("EAGER")),
        }
    }

    /// The memory limits the environment configured.
    pub(crate) fn configured(&self) -> &DeviceLimits<u64> {
        &self.configured
    }

    /// The quota of CUDA device `device` (as the application numbers it), or
    /// `None` when it is unlimited; `Some(0)` refuses every allocation. Under
    /// a hypervisor, read live from its read-only limits; locally, resolved
    /// once per device.
    pub(crate) fn limit(&self, ctx: &'static Context, device: usize) -> Option<u64> {
        match ctx.grant() {
            Grant::Hypervisor(_) => self.limit_for(ctx, device, ctx.device_uuid(device).as_deref()),
            // Refused: cuInit failed; should a call come anyway, the device
            // shows nothing and every reservation is refused.
            Grant::Refused => Some(0),
            Grant::Local => {
                let slot = self.limits.get(device)?;
                *slot.get_or_init(|| {
                    let uuid = ctx.device_uuid(device);
                    let limit = self.limit_for(ctx, device, uuid.as_deref());
                    if let (Some(bytes), Some(ledger), Some(entry)) =
                        (limit, ctx.ledger(), ctx.ledger_entry(device))
                        && bytes > 0
                        && let Err(error) = ledger.set_quota(entry, bytes)
                    {
                        tracing::warn!(device, %error, "quota not recorded in the pod ledger");
                    }
                    tracing::debug!(device, ?uuid, ?limit, "memory quota resolved");
                    limit
                })
            }
        }
    }

    /// The quota of a device known by index and UUID: the hypervisor's for
    /// that UUID when it granted limits (or, in a provisioned container,
    /// the configured one where that is lower), else the configured one. Under the
    /// hypervisor a GPU it published no limits for (one the pod was not
    /// given, a UUID it does not know) has a quota of 0: every allocation
    /// on it is refused, where no quota would leave it unlimited. So has,
    /// locally, a GPU that limits naming GPUs only by UUID do not name.
    pub(crate) fn limit_for(
        &self,
        ctx: &'static Context,
        device: usize,
        uuid: Option<&str>,
    ) -> Option<u64> {
        if let Some(limits) = ctx.hypervisor_limits() {
            let Some(gpu) = uuid.and_then(|uuid| limits.find(uuid)) else {
                return Some(0);
            };
            let bytes = gpu.quota.load(Ordering::Acquire);
            // In a provisioned container a lower local limit tightens the
            // published quota; a higher one changes nothing.
            let local = ctx
                .local_limits_tighten()
                .then(|| self.configured.resolve(device as u32, uuid))
                .flatten();
            return [(bytes > 0).then_some(bytes), local]
                .into_iter()
                .flatten()
                .min();
        }
        if let Some(error) = uuid.and_then(|uuid| self.configured.named_twice(device as u32, uuid))
        {
            // Refused at cuInit already; a program that goes on gets no memory.
            tracing::error!(device, %error, "nothing may be allocated on the device");
            return Some(0);
        }
        if self.configured.lookup(device as u32, uuid).is_none()
            && self.configured.names_only_uuids()
        {
            // Limits that name GPUs only by UUID, none of them this one: a
            // mistyped or stale UUID must not leave the GPU unlimited.
            tracing::error!(
                device,
                ?uuid,
                "the memory limits name GPUs by UUID, none of them this one: nothing may be allocated on it"
            );
            return Some(0);
        }
        self.configured
            .resolve(device as u32, uuid)
            .filter(|bytes| *bytes > 0)
    }

    /// The CUDA device `device`, or that of the calling thread's current
    /// context (`None`), when it is limited; `Bypass` when nothing is
    /// enforced there (without a current context the driver reports its
    /// own error).
    pub(crate) fn limited_device(
        &self,
        ctx: &'static Context,
        device: Option<CUdevice>,
    ) -> Result<usize> {
        let device = match device {
            Some(device) => device,
            None => ctx
                .driver()
                .ok_or(LimiterError::Bypass(Pass::DriverNotResolved))?
                .current_device()
                .map_err(|_| LimiterError::Bypass(Pass::NoCurrentContext))?,
        };
        let device = usize::try_from(device).map_err(|_| LimiterError::Bypass(Pass::BadDevice))?;
        match self.limit(ctx, device) {
            Some(_) => Ok(device),
            None => Err(LimiterError::Bypass(Pass::DeviceUnlimited)),
        }
    }

    /// Where `bytes` on `device` would be reserved: the pod's ledger, the
    /// GPU's entry in it and the quota. A quota of 0 is a GPU on which
    /// nothing may be taken (one the hypervisor gave the pod no limits for):
    /// refused here, since to the ledger 0 would mean no quota at all.
    pub(crate) fn reservable(
        &self,
        ctx: &'static Context,
        device: usize,
        bytes: u64,
    ) -> Result<(&'static PodLedger, usize, u64)> {
        let Some(limit) = self.limit(ctx, device).filter(|&bytes| bytes > 0) else {
            tracing::debug!(device, bytes, "refused: the pod has no quota on the device");
            return Err(LimiterError::OverQuota {
                device,
                requested: bytes,
                used: 0,
                quota: 0,
            });
        };
        let ledger = ctx.ledger().ok_or(LimiterError::LedgerUnavailable)?;
        let entry = ctx
            .ledger_entry(device)
            .ok_or(LimiterError::LedgerUnavailable)?;
        // What the hypervisor's audit found the pod holding beyond its
        // ledger leaves that much less to reserve.
        let unaccounted = self.unaccounted(ctx, device);
        if unaccounted >= limit {
            tracing::debug!(
                device,
                bytes,
                unaccounted,
                limit,
                "refused: what the hypervisor's audit charged the pod fills its quota"
            );
            return Err(LimiterError::OverQuota {
                device,
                requested: bytes,
                used: unaccounted,
                quota: limit,
            });
        }
        Ok((ledger, entry, limit - unaccounted))
    }

    /// Driver-held memory the hypervisor's audit charged the pod on
    /// `device` beyond its ledger; 0 without a hypervisor.
    pub(crate) fn unaccounted(&self, ctx: &'static Context, device: usize) -> u64 {
        if ctx.hypervisor_limits().is_none() {
            return 0;
        }
        ctx.device_uuid(device)
            .map_or(0, |uuid| self.unaccounted_of(ctx, &uuid))
    }

    /// [`unaccounted`](Self::unaccounted) of the GPU `uuid`.
    pub(crate) fn unaccounted_of(&self, ctx: &'static Context, uuid: &str) -> u64 {
        ctx.hypervisor_limits()
            .and_then(|limits| limits.find(uuid))
            .map_or(0, |gpu| gpu.unaccounted.load(Ordering::Acquire))
    }

    /// Reserves `bytes` on `device` for an allocation about to be made.
    pub(crate) fn reserve(
        &self,
        ctx: &'static Context,
        device: usize,
        bytes: u64,
    ) -> Result<Reservation<'_>> {
        if matches!(ctx.grant(), Grant::Refused) {
            return Err(LimiterError::Misconfigured("no limits granted"));
        }
        self.measure_overhead(ctx, device, false);
        let (ledger, entry, limit) = self.reservable(ctx, device, bytes)?;
        let change = self.change();
        if let Err(error) = ledger.try_reserve_under(entry, bytes, limit) {
            // Pools may hold less than they are charged (given back at a
            // synchronisation): charged what they hold, is there room?
            if !self.has_pools() {
                return Err(refusal(device, error));
            }
            self.settle_pools(ctx);
            ledger
                .try_reserve_under(entry, bytes, limit)
                .map_err(|error| refusal(device, error))?;
        }
        Ok(Reservation {
            quota: self,
            _change: change,
            ledger,
            limit,
            charge: Charge {
                device: entry,
                bytes,
            },
        })
    }

    /// Marks a free under way until the returned guard drops (after the
    /// driver freed and the ledger was credited, or the charge restored).
    pub(crate) fn change(&self) -> Change<'_> {
        Change::begin(&self.changes)
    }

    /// Removes a resource's charge before it is freed; `None` when it was not
    /// charged (allocated before the limiter, or on an unlimited device).
    pub(crate) fn take(&self, resource: Resource) -> Option<Charge> {
        self.charges.lock().ok()?.remove(&resource)
    }

    /// Puts a charge back after the driver refused to free its resource.
    pub(crate) fn restore(&self, resource: Resource, charge: Charge) {
        if let Ok(mut charges) = self.charges.lock() {
            charges.insert(resource, charge);
        }
    }

    /// Gives a freed resource's charge back to the pod.
    pub(crate) fn credit(&self, ctx: &'static Context, charge: Charge) {
        if let Some(ledger) = ctx.ledger() {
            release(ledger, charge.device, charge.bytes);
        }
    }
}

/// An accepted reservation; given back on drop unless committed.
pub(crate) struct Reservation<'a> {
    quota: &'a MemoryQuota,
    /// Ends once the driver allocated and the charge is kept, or given back.
    _change: Change<'a>,
    ledger: &'static PodLedger,
    /// The quota reserved against (0 = unlimited).
    limit: u64,
    /// `device` is the ledger entry.
    charge: Charge,
}

impl Reservation<'_> {
    /// Changes the reserved size to what the driver actually allocated.
    pub(crate) fn resize(&mut self, bytes: u64) -> Result<()> {
        let Charge {
            device,
            bytes: held,
        } = self.charge;
        if bytes > held {
            self.ledger
                .try_reserve_under(device, bytes - held, self.limit)
                .map_err(|error| refusal(device, error))?;
        } else {
            release(self.ledger, device, held - bytes);
        }
        self.charge.bytes = bytes;
        Ok(())
    }

    /// Keeps the reservation as the charge of `resource`.
    pub(crate) fn commit(mut self, resource: Resource) {
        if let Ok(mut charges) = self.quota.charges.lock() {
            charges.insert(resource, self.charge);
            // Kept: the drop gives nothing back, and ends the change.
            self.charge.bytes = 0;
        }
        // A poisoned map drops the reservation: the pod gets the bytes back
        // rather than leaking them forever.
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        release(self.ledger, self.charge.device, self.charge.bytes);
    }
}

/// Why the ledger refused a reservation, as the detour reports it.
pub(crate) fn refusal(device: usize, error: LedgerError) -> LimiterError {
    match error {
        LedgerError::OverQuota {
            quota,
            used,
            requested,
            ..
        } => {
            tracing::debug!(device, requested, used, quota, "refused at the pod's quota");
            LimiterError::OverQuota {
                device,
                requested,
                used,
                quota,
            }
        }
        error => {
            tracing::error!(device, %error, "pod ledger refused a reservation");
            LimiterError::LedgerUnavailable
        }
    }
}

/// Gives bytes back to the pod; a failure can only be a bad device index,
/// which no reservation can have.
fn release(ledger: &PodLedger, device: usize, bytes: u64) {
    if let Err(error) = ledger.release(device, bytes) {
        tracing::warn!(device, %error, "release refused by the pod ledger");
    }
}
