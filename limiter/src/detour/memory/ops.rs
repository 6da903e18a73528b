//! Memory policy, in safe Rust on typed values: reserve before allocating,
//! credit after freeing, and the pod's view of its memory. The adapters
//! (`hooks.rs`) read and write the caller's pointers and hand the driver's
//! original over as a closure; nothing here touches a raw pointer. Past the
//! quota, linear memory may be served from host memory (`spill`) when the
//! pod opted in; the other APIs stay on the device. Within the quota, an
//! allocation the GPU cannot hold (other pods fill it) asks the hypervisor
//! to make room by swapping idle pods out, and is tried again.

use super::super::room::{self, wants_room};
use crate::backing::{Backing, BackingError};
use crate::context::Context;
use crate::error::{LimiterError, Pass, Result};
use crate::quota::{MemoryQuota, Reservation, Resource};
use crate::spill::Spill;
use crate::sys::{
    CU_MEM_LOCATION_TYPE_DEVICE, CUdevice, CUdeviceptr, CUmemAllocationProp, CUmemoryPool, CUresult,
};

/// The quota, the oversubscription policy, the memory the limiter backs,
/// and the context they answer in.
#[derive(Clone, Copy)]
pub(super) struct Memory {
    pub quota: &'static MemoryQuota,
    pub spill: &'static Spill,
    pub backing: &'static Backing,
    pub ctx: &'static Context,
    /// The driver's own free memory on the current device, as it answers
    /// (`None` where it does not).
    pub driver_free: fn() -> Option<u64>,
}

/// Where a linear allocation was served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Served {
    /// The driver's own answer (the pointer is where it wrote it).
    Device(CUresult),
    /// Past the quota, from pinned mapped host memory at this device address.
    Host(CUdeviceptr),
    /// Backed by the limiter with the VMM API, at this address.
    Backed(CUdeviceptr),
}

/// Where a pitched allocation was served from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pitched {
    /// The driver's own answer (pointer and pitch are where it wrote them).
    Device(CUresult),
    /// Past the quota, from host memory, or backed by the limiter: its
    /// device address and pitch.
    Served { pointer: CUdeviceptr, pitch: usize },
}

/// An allocation API that is never served from host memory, and why.
#[derive(Debug, Clone, Copy)]
pub(super) struct DeviceOnly {
    pub api: &'static str,
    pub why: &'static str,
}

impl DeviceOnly {
    pub(super) const MANAGED: Self = Self {
        api: "cuMemAllocManaged",
        why: "cuMemAdvise and cuMemPrefetchAsync need managed memory",
    };
    pub(super) const PHYSICAL: Self = Self {
        api: "cuMemCreate",
        why: "VMM memory is mapped as device memory",
    };
    /// An array API (`api`): opaque device layouts.
    pub(super) const fn array(api: &'static str) -> Self {
        Self {
            api,
            why: "arrays are opaque device layouts",
        }
    }
}

/// The device an allocation goes to.
#[derive(Debug, Clone, Copy)]
pub(super) enum Placement {
    /// The device of the calling thread's current context.
    Current,
    /// A device named by the call.
    Device(CUdevice),
}

impl Memory {
    /// The limited device at `placement`; `Bypass` when there is nothing to
    /// enforce.
    fn limited_device(self, placement: Placement) -> Result<usize> {
        let device = match placement {
            Placement::Current => None,
            Placement::Device(device) => Some(device),
        };
        self.quota.limited_device(self.ctx, device)
    }

    /// Reserves `bytes` at `placement`, runs `allocate`, and keeps the charge
    /// under the resource it made (`made` is asked only after it succeeded).
    pub(super) fn allocate(
        self,
        placement: Placement,
        bytes: u64,
        allocate: impl FnMut() -> CUresult,
        made: impl FnOnce() -> Resource,
    ) -> Result<CUresult> {
        let device = self.limited_device(placement)?;
        if bytes == 0 {
            return Err(LimiterError::Bypass(Pass::EmptyAllocation));
        }
        let (result, reservation) = self.reserve_and_allocate(device, bytes, allocate)?;
        if let Some(reservation) = reservation {
            reservation.commit(made());
        }
        Ok(result)
    }

    /// Reserves `bytes` on `device` and runs `allocate`: its result, with the
    /// reservation when it succeeded (given back otherwise), room made and
    /// the allocation tried again as [`Self::reserve_and_try`] says.
    fn reserve_and_allocate(
        self,
        device: usize,
        bytes: u64,
        mut allocate: impl FnMut() -> CUresult,
    ) -> Result<(CUresult, Option<Reservation<'static>>)> {
        let allocated = || {
            let result = allocate();
            if result.is_success() {
                Ok(result)
            } else {
                Err(result)
            }
        };
        Ok(
            match self.reserve_and_try(device, bytes, allocated, |&result| Some(result))? {
                Ok((result, reservation)) => (result, Some(reservation)),
                Err(result) => (result, None),
            },
        )
    }

    /// Reserves `bytes` on `device` and runs `attempt`: what it made, with
    /// the reservation, or how it failed (the reservation given back).
    /// When the driver answers out of memory (`driver_said` of the failure)
    /// to what the quota admitted, the GPU is full of other pods: under a
    /// hypervisor, it is asked to make room (the reservation given back
    /// while it does), and `attempt` runs again, reserved again, for at
    /// most [`ROOM_ROUNDS`] rooms made. A refusal by the quota is an error,
    /// in any round.
    fn reserve_and_try<T, E>(
        self,
        device: usize,
        bytes: u64,
        mut attempt: impl FnMut() -> std::result::Result<T, E>,
        driver_said: impl Fn(&E) -> Option<CUresult>,
    ) -> Result<std::result::Result<(T, Reservation<'static>), E>> {
        let mut rooms = 0;
        loop {
            let reservation = self.quota.reserve(self.ctx, device, bytes)?;
            let failure = match attempt() {
                Ok(made) => return Ok(Ok((made, reservation))),
                Err(failure) => failure,
            };
            drop(reservation);
            let no_memory = driver_said(&failure).is_some_and(|result| wants_room(result, rooms));
            if !(no_memory && self.made_room(device, bytes)) {
                return Ok(Err(failure));
            }
            rooms += 1;
        }
    }

    /// Whether the hypervisor made room on CUDA device `device` for `bytes`
    /// the driver could not find ([`room::made_room`]).
    fn made_room(self, device: usize, bytes: u64) -> bool {
        room::made_room(self.ctx, device, bytes, self.driver_free)
    }

    /// Linear memory on the current device ([`Self::allocate`]); past the
    /// quota, served from host memory when the pod may spill there.
    pub(super) fn allocate_linear(
        self,
        bytes: u64,
        allocate: impl FnMut() -> CUresult,
        made: impl FnOnce() -> Resource,
    ) -> Result<Served> {
        if let Some(pointer) = self.allocate_backed(bytes) {
            return Ok(Served::Backed(pointer));
        }
        match self.allocate(Placement::Current, bytes, allocate, made) {
            Ok(result) => Ok(Served::Device(result)),
            Err(over) => self.serve_from_host(over, bytes).map(Served::Host),
        }
    }

    /// `bytes` on the current device backed by the limiter (`crate::backing`),
    /// charged its rounded size; `None` when it is not to be backed or could
    /// not be (the quota refused the rounded size, or a VMM call failed):
    /// the caller then allocates as the driver would. Where the driver
    /// has no memory for it, room is asked for as for any allocation, and
    /// it is backed again: memory the driver allocated instead could only
    /// leave the GPU by the driver's checkpoint.
    fn allocate_backed(self, bytes: u64) -> Option<CUdeviceptr> {
        let plan = self.backing.plan(self.ctx, bytes)?;
        let device = self.limited_device(Placement::Current).ok()?;
        let backed = || self.backing.back(self.ctx, plan, bytes);
        // Only the driver's answer as it creates the memory says whether the
        // GPU is full: the other steps' failures are the VMM API's.
        let driver_said = |error: &BackingError| match error {
            BackingError::Create(created) => Some(created.code()),
            _ => None,
        };
        match self
            .reserve_and_try(device, plan.size, backed, driver_said)
            .ok()?
        {
            Ok((pointer, reservation)) => {
                reservation.commit(Resource::Pointer(pointer));
                tracing::debug!(device, bytes, held = plan.size, pointer, "backed");
                Some(pointer)
            }
            Err(error) => {
                tracing::debug!(device, bytes, %error, "not backed; the driver allocates");
                None
            }
        }
    }

    /// Stream-ordered memory from `pool` on the current device: charged as
    /// the pool's reservation (see `quota::pools`), the whole size reserved
    /// first. Past the quota the pool gives back what it keeps unused
    /// (`trim`) and the allocation is tried once more; then it is served
    /// from host memory when the pod may spill there. `made`: the pointer,
    /// once the driver allocated.
    pub(super) fn allocate_pooled(
        self,
        pool: CUmemoryPool,
        bytes: u64,
        mut allocate: impl FnMut() -> CUresult,
        made: impl FnOnce() -> CUdeviceptr,
        trim: impl FnOnce(),
    ) -> Result<Served> {
        let device = self.limited_device(Placement::Current)?;
        if bytes == 0 {
            return Err(LimiterError::Bypass(Pass::EmptyAllocation));
        }
        self.quota.settle_pool(self.ctx, pool);
        let outcome = match self.reserve_and_allocate(device, bytes, &mut allocate) {
            Err(LimiterError::OverQuota { .. }) => {
                trim();
                self.quota.settle_pool(self.ctx, pool);
                self.reserve_and_allocate(device, bytes, &mut allocate)
            }
            outcome => outcome,
        };
        match outcome {
            Ok((result, Some(reservation))) => {
                self.quota
                    .commit_to_pool(self.ctx, reservation, pool, made());
                Ok(Served::Device(result))
            }
            Ok((result, None)) => Ok(Served::Device(result)),
            Err(over) => self.serve_from_host(over, bytes).map(Served::Host),
        }
    }

    /// Memory that must stay on the device ([`Self::allocate`]); past the
    /// quota it is refused, the reason logged when the pod opted in.
    pub(super) fn allocate_on_device(
        self,
        placement: Placement,
        bytes: u64,
        only: DeviceOnly,
        allocate: impl FnMut() -> CUresult,
        made: impl FnOnce() -> Resource,
    ) -> Result<CUresult> {
        let outcome = self.allocate(placement, bytes, allocate, made);
        if let Err(LimiterError::OverQuota { device, .. }) = &outcome
            && self.spill.cap(self.ctx, *device).is_some()
        {
            let DeviceOnly { api, why } = only;
            tracing::warn!(
                device,
                api,
                why,
                "past the quota; this API is not oversubscribed"
            );
        }
        outcome
    }

    /// `refused` unless it is the quota's refusal and `bytes` can be served
    /// from host memory: then the device address of the spill.
    fn serve_from_host(self, refused: LimiterError, bytes: u64) -> Result<CUdeviceptr> {
        let LimiterError::OverQuota { device, .. } = refused else {
            return Err(refused);
        };
        match self.spill.allocate(self.ctx, device, bytes) {
            Ok(pointer) => Ok(pointer),
            Err(why) => {
                if self.spill.cap(self.ctx, device).is_some() {
                    tracing::info!(device, bytes, why, "past the quota; not spilled");
                }
                Err(refused)
            }
        }
    }

    /// VMM physical memory with properties `prop`: charged to the device it
    /// names; host memory is not ours to count.
    pub(super) fn allocate_physical(
        self,
        prop: &CUmemAllocationProp,
        bytes: u64,
        allocate: impl FnMut() -> CUresult,
        made: impl FnOnce() -> Resource,
    ) -> Result<CUresult> {
        if prop.location.type_ != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(LimiterError::Bypass(Pass::HostMemory));
        }
        let placement = Placement::Device(prop.location.id);
        self.allocate_on_device(placement, bytes, DeviceOnly::PHYSICAL, allocate, made)
    }

    /// A pitched allocation of `height` rows of `width` bytes on the current
    /// device: reserved for the usual pitch, then settled on the pitch the
    /// driver chose (`made`: the pointer and the pitch). If that pitch does
    /// not fit, the allocation is undone with `free`, as if the driver had
    /// refused. Past the quota, the usual pitch is served from host memory
    /// when the pod may spill there.
    pub(super) fn allocate_pitched(
        self,
        width: usize,
        height: usize,
        allocate: impl FnMut() -> CUresult,
        made: impl FnOnce() -> (CUdeviceptr, usize),
        free: impl FnOnce(CUdeviceptr),
    ) -> Result<Pitched> {
        let device = self.limited_device(Placement::Current)?;
        let estimate = width
            .checked_next_multiple_of(PITCH_ESTIMATE_ALIGNMENT)
            .and_then(|row| row.checked_mul(height))
            .ok_or(LimiterError::Bypass(Pass::SizeOverflows))?;
        if estimate == 0 {
            return Err(LimiterError::Bypass(Pass::EmptyAllocation));
        }
        if let Some(pointer) = self.allocate_backed(estimate as u64) {
            let pitch = estimate / height;
            return Ok(Pitched::Served { pointer, pitch });
        }
        let (result, mut reservation) =
            match self.reserve_and_allocate(device, estimate as u64, allocate) {
                Ok((result, Some(reservation))) => (result, reservation),
                Ok((result, None)) => return Ok(Pitched::Device(result)),
                Err(over) => {
                    let pointer = self.serve_from_host(over, estimate as u64)?;
                    let pitch = estimate / height;
                    return Ok(Pitched::Served { pointer, pitch });
                }
            };
        let (pointer, pitch) = made();
        let actual = (pitch as u64).saturating_mul(height as u64);
        if let Err(over) = reservation.resize(actual) {
            free(pointer);
            return Err(over);
        }
        reservation.commit(Resource::Pointer(pointer));
        Ok(Pitched::Device(result))
    }

    /// Frees linear memory at `pointer`: host memory it was spilled to, else
    /// with `free` as [`Self::free`]. `ordered`: a stream-ordered free.
    pub(super) fn free_linear(
        self,
        pointer: CUdeviceptr,
        ordered: bool,
        free: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        if let Some(freed) = self.spill.free(self.ctx, pointer, ordered) {
            return Ok(freed);
        }
        if self.backing.holds(pointer) {
            // Waits for the context whether the free is stream-ordered or not.
            let free = || self.backing.free(self.ctx, pointer);
            return self.free(Resource::Pointer(pointer), free);
        }
        if let Some(pool) = self.quota.pool_of(pointer) {
            // Charged as its pool's: the pool may hold less once it is freed.
            let result = free();
            if result.is_success() {
                self.quota.freed_from_pool(self.ctx, pointer, pool);
            }
            return Ok(result);
        }
        let freed = self.free(Resource::Pointer(pointer), free);
        if freed.as_ref().is_ok_and(|result| result.is_success()) {
            self.backing.freed(pointer);
        }
        freed
    }

    /// Frees `resource` with `free` and credits its charge if that succeeds.
    pub(super) fn free(
        self,
        resource: Resource,
        free: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let _change = self.quota.change();
        let charge = self
            .quota
            .take(resource)
            .ok_or(LimiterError::Bypass(Pass::NotCharged))?;
        let result = free();
        if result.is_success() {
            self.quota.credit(self.ctx, charge);
        } else {
            self.quota.restore(resource, charge);
        }
        Ok(result)
    }

    /// The pool `cuMemAllocAsync` takes from on the current device.
    pub(super) fn current_pool(self) -> Option<CUmemoryPool> {
        let driver = self.ctx.driver()?;
        driver.held.current_pool(driver.current_device().ok()?)
    }

    /// `(free, total)` of the current device as the pod sees it, from the
    /// real ones; `Bypass` when it is unlimited.
    pub(super) fn current_report(self, real_free: u64, real_total: u64) -> Result<(u64, u64)> {
        let device = self.limited_device(Placement::Current)?;
        self.quota
            .report(self.ctx, device, real_free, real_total)
            .ok_or(LimiterError::Bypass(Pass::DeviceUnlimited))
    }

    /// The total the pod sees for `device`; `Bypass` when it is unlimited.
    pub(super) fn total(self, device: CUdevice, real_total: u64) -> Result<u64> {
        let device = self.limited_device(Placement::Device(device))?;
        let limit = self
            .quota
            .limit(self.ctx, device)
            .ok_or(LimiterError::Bypass(Pass::DeviceUnlimited))?;
        Ok(limit.min(real_total))
    }
}

/// The driver rounds the pitch up to its alignment; reserve for the usual
/// 512 bytes and settle on the real pitch afterwards.
const PITCH_ESTIMATE_ALIGNMENT: usize = 512;
