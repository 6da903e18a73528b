//! The CUDA IPC calls' logic: backed memory exported, the limiter's
//! handles imported and closed by `crate::backing::ipc`; everything else
//! goes to the driver.

use crate::backing::ipc::Ticket;
use crate::entry;
use crate::error::{LimiterError, Pass, Result};
use crate::sys::{CUdeviceptr, CUipcMemHandle, CUresult};

/// The handle's bytes for the backed range holding `pointer`, or the
/// status the program gets; `Bypass` for memory the limiter does not back.
/// The pod is brought back first: its memory must be on the GPU.
pub(super) fn export(pointer: CUdeviceptr) -> Result<Result<[u8; 64], CUresult>> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    if limiter.backing.range(pointer).is_none() {
        return Err(LimiterError::Bypass(Pass::NotBacked));
    }
    limiter.resident();
    let exported = limiter.backing.export_ipc(&limiter.context, pointer);
    Ok(exported.map(Ticket::to_bytes).map_err(|error| {
        tracing::warn!(address = pointer, %error, "backed memory not exported for CUDA IPC");
        error.code()
    }))
}

/// The ticket a handle holds; `Bypass` for the driver's own handles.
pub(super) fn ticket(handle: &CUipcMemHandle) -> Result<Ticket> {
    Ticket::from_bytes(&handle.reserved).ok_or(LimiterError::Bypass(Pass::NotBacked))
}

/// Maps the memory `ticket` names: its address here, or the status the
/// program gets.
pub(super) fn import(ticket: Ticket) -> Result<CUdeviceptr, CUresult> {
    let limiter = entry::limiter().ok_or(CUresult::ERROR_NOT_INITIALIZED)?;
    limiter.resident();
    limiter
        .backing
        .import_ipc(&limiter.context, ticket)
        .map_err(|error| {
            tracing::warn!(?ticket, %error, "backed memory of another process not imported");
            error.code()
        })
}

/// Closes an import of this process; `Bypass` for the driver's own.
pub(super) fn close(pointer: CUdeviceptr) -> Result<CUresult> {
    let limiter = entry::limiter().ok_or(LimiterError::Bypass(Pass::LimitsOff))?;
    limiter
        .backing
        .close_ipc(&limiter.context, pointer)
        .ok_or(LimiterError::Bypass(Pass::NotBacked))
}
