//! Room on a GPU that other pods fill: where the driver answers out of
//! memory to what the pod's quota admits (an allocation, the driver's own
//! taking for a library's first use, or a kernel launch that loads its
//! code), the hypervisor is asked to make
//! room by swapping idle pods out, and the call is tried again, a few times
//! at most.

use gpushare_utils::quote::Clipped;

use crate::context::Context;
use crate::sys::CUresult;

/// The least room asked for: the driver cannot hand out the last MiB it
/// has (an allocation of 1 KiB was refused with more free), a kernel's
/// first launch loads code whose size no call says, and other pods' loads
/// take what is free meanwhile.
const MIN_ROOM: u64 = 64 << 20;

/// Rooms a call asks the hypervisor for, at most, before it fails as the
/// driver said: other pods' allocations may take what one freed.
const ROOM_ROUNDS: u32 = 3;

/// Whether a call the driver answered `result`, after `rooms` rooms made
/// for it, asks the hypervisor for another: only for out of memory.
pub(super) fn wants_room(result: CUresult, rooms: u32) -> bool {
    result == CUresult::ERROR_OUT_OF_MEMORY && rooms < ROOM_ROUNDS
}

/// Whether the hypervisor made room on CUDA device `device` for `bytes`
/// (at least [`MIN_ROOM`]) the driver could not find, or found the GPU
/// with that room once it answered (another swap freed it meanwhile);
/// false without a hypervisor, or when it freed nothing and found no room,
/// or could not be asked (the call then fails as the driver said).
/// `driver_free`: the driver's own free memory on the current device, told
/// to the hypervisor where `device` is the current one (NVML counts as free
/// what the driver keeps).
pub(super) fn made_room(
    ctx: &'static Context,
    device: usize,
    bytes: u64,
    driver_free: fn() -> Option<u64>,
) -> bool {
    let driver_free = ctx
        .driver()
        .and_then(|driver| driver.current_device().ok())
        .filter(|&current| usize::try_from(current).ok() == Some(device))
        .and_then(|_| driver_free());
    made_room_saying(ctx, device, bytes, driver_free)
}

/// [`made_room`], the driver's free memory on `device` told as the caller
/// knows it (`None`: unknown; `Some(0)` where the driver refused what
/// NVML shows free, so that the room made covers what the driver keeps).
pub(super) fn made_room_saying(
    ctx: &'static Context,
    device: usize,
    bytes: u64,
    driver_free: Option<u64>,
) -> bool {
    let bytes = bytes.max(MIN_ROOM);
    let Some(link) = ctx.hypervisor() else {
        return false;
    };
    let Some(uuid) = ctx.device_uuid(device) else {
        return false;
    };
    match link.room(&uuid, bytes, driver_free) {
        Ok(answer) if answer.freed > 0 || answer.room => {
            tracing::info!(
                device,
                bytes,
                freed = answer.freed,
                "the hypervisor made room on the GPU, or found it there"
            );
            true
        }
        Ok(answer) => {
            let why = Clipped(&answer.message);
            tracing::info!(device, bytes, %why, "the GPU is full and the hypervisor made no room");
            false
        }
        Err(error) => {
            tracing::warn!(device, bytes, %error, "the GPU is full and the hypervisor could not be asked for room");
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_out_of_memory_asks_for_room_and_only_a_few_times() {
        let oom = CUresult::ERROR_OUT_OF_MEMORY;
        let cases = [
            (oom, 0, true),
            (oom, ROOM_ROUNDS - 1, true),
            (oom, ROOM_ROUNDS, false),
            (CUresult::ERROR_INVALID_VALUE, 0, false),
            (CUresult::ERROR_NOT_INITIALIZED, 0, false),
            (CUresult::SUCCESS, 0, false),
        ];
        for (result, rooms, asks) in cases {
            assert_eq!(wants_room(result, rooms), asks, "{result:?} after {rooms}");
        }
    }
}
