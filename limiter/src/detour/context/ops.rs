//! Context policy: a context's footprint is reserved against the pod's quota
//! as this process's driver overhead on the device before the driver
//! creates it, so that processes of a pod creating contexts at once cannot
//! pass the quota together; right after, the overhead is measured and the
//! estimate replaced by what the driver really took.
//!
//! The estimate is the largest first context a process of the pod was
//! measured at on that GPU (kept in the ledger), or
//! [`DEFAULT_CONTEXT_BYTES`] before any was. A context that does not fit is
//! refused with `CUDA_ERROR_OUT_OF_MEMORY`, like an allocation; one the
//! quota admits but the GPU has no room for (other pods fill it) asks the
//! hypervisor for room, as an allocation does, and is tried again. Every
//! call here needs the GPU: a swapped-out pod is brought back first.

use super::super::nvml::gpu_free;
use super::super::room::{made_room_saying, wants_room};
use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::grant::Grant;
use crate::quota;
use crate::sys::{CUdevice, CUresult};

/// What a context is reserved at before any of the pod's was measured on
/// the GPU: about what one takes on an H100 (driver 580), so that the first
/// processes of a pod racing cannot pass the quota by much.
pub(super) const DEFAULT_CONTEXT_BYTES: u64 = 512 << 20;

/// What a context may take beyond its estimate when room is made for it:
/// a context larger than the pod's first (more modules).
const CONTEXT_MARGIN: u64 = 128 << 20;

/// Which call creates the context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Creation {
    /// `cuDevicePrimaryCtxRetain`: creates the primary context only if this
    /// process holds none on the device yet.
    Primary,
    /// `cuCtxCreate*`: always a new context.
    Extra,
}

/// Reserves the context's footprint, runs `create` (the driver's original;
/// again where the GPU had no room and the hypervisor made some), then
/// charges what it really took.
pub(super) fn create(
    device: CUdevice,
    creation: Creation,
    mut create: impl FnMut() -> CUresult,
) -> Result<CUresult> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter.resident();
    let (ctx, memory) = (&limiter.context, &limiter.memory);
    let device = usize::try_from(device).map_err(|_| LimiterError::Bypass(Pass::BadDevice))?;
    if matches!(ctx.grant(), Grant::Refused) {
        return Err(LimiterError::Misconfigured("no limits granted"));
    }
    if memory.limit(ctx, device).is_none() {
        return Err(LimiterError::Bypass(Pass::DeviceUnlimited));
    }
    let (ledger, entry, limit) = memory.reservable(ctx, device, DEFAULT_CONTEXT_BYTES)?;
    if creation == Creation::Primary && ledger.process_overhead(entry).unwrap_or(0) > 0 {
        return Err(LimiterError::Bypass(Pass::ContextCharged));
    }
    let estimate = match ledger.context_bytes(entry) {
        Ok(learned) if learned > 0 => learned,
        _ => DEFAULT_CONTEXT_BYTES,
    };
    let held = quota::raise_overhead(ledger, entry, device, limit, estimate)?;
    // On a GPU other pods fill, room is made before the driver is asked
    // where NVML shows too little free: a refused context's next try was
    // answered CUDA_ERROR_DEVICES_UNAVAILABLE once another pod's checkpoint
    // had just ended (an H200, driver 580).
    let room = estimate.saturating_add(CONTEXT_MARGIN);
    if ctx
        .device_uuid(device)
        .and_then(|uuid| gpu_free(&uuid))
        .is_some_and(|free| free < room)
    {
        made_room_saying(ctx, device, room, None);
    }
    // A refusal with NVML showing the room free: the driver keeps some of
    // that for itself (no context yet to ask it how much), so it is said
    // to have none, and the room made covers that too.
    let mut rooms = 0;
    let result = loop {
        let result = create();
        if !(wants_room(result, rooms) && made_room_saying(ctx, device, room, Some(0))) {
            break result;
        }
        rooms += 1;
    };
    if !result.is_success() {
        if let Err(error) = ledger.set_overhead(entry, held) {
            tracing::warn!(device, %error, "context reservation not given back");
        }
        return Ok(result);
    }
    if memory.measure_overhead(ctx, device, true)
        && let Ok(measured) = ledger.process_overhead(entry)
    {
        memory.set_context_floor(device, measured);
    }
    // This process's first context on the device: what it took is what the
    // next one of the pod is reserved at (unchanged when NVML cannot say).
    if held == 0
        && let Ok(measured) = ledger.process_overhead(entry)
    {
        let _ = ledger.learn_context_bytes(entry, measured);
    }
    Ok(result)
}

/// What a green context is reserved at before it is measured: one takes
/// about 5 MiB past the primary context on an H100 (driver 580), far less
/// than a context, so reserving a context's size would refuse green
/// contexts that fit.
pub(super) const GREEN_CONTEXT_BYTES: u64 = 8 << 20;

/// Reserves a green context's footprint, runs `create`, and measures what
/// it took; a pod left over its quota gets it destroyed again (`destroy`)
/// and the call refused.
pub(super) fn create_green(
    device: CUdevice,
    create: impl FnOnce() -> CUresult,
    destroy: impl FnOnce(),
) -> Result<CUresult> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter.resident();
    let (ctx, memory) = (&limiter.context, &limiter.memory);
    if matches!(ctx.grant(), Grant::Refused) {
        return Err(LimiterError::Misconfigured("no limits granted"));
    }
    let device = memory.limited_device(ctx, Some(device))?;
    memory.measured(ctx, device, GREEN_CONTEXT_BYTES, create, destroy)
}

/// Runs `destroy`, which may end a context: what it held is measured again.
pub(super) fn destroyed(destroy: impl FnOnce() -> CUresult) -> Result<CUresult> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter.resident();
    let result = destroy();
    if result.is_success() {
        // The contexts left are measured again from scratch.
        for device in 0..gpushare_utils::MAX_DEVICES {
            limiter.memory.set_context_floor(device, 0);
        }
        limiter.memory.remeasure(&limiter.context);
    }
    Ok(result)
}
