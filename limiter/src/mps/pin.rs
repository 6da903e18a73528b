//! At load, before the program reads its environment: a process that must
//! be an MPS client and whose `CUDA_VISIBLE_DEVICES` is unset is given the
//! GPU its MPS server serves, as the node daemon names it beside the pipe
//! folder ([`gpushare_utils::served_gpu`]). Programs that count GPUs
//! through NVML (PyTorch) read the variable once, early (Python copies the
//! environment when it starts), so `cuInit` is too late. A provisioned
//! container has the variable from its CDI spec or device plugin answer;
//! a process on the node (local mode) gets it here.
//!
//! Only a view is chosen here, never a limit: after `cuInit` the views must
//! agree ([`super::view`]) or CUDA is refused, so a file that names another
//! GPU refuses the process, and one that is missing leaves the decision to
//! that check.

use std::path::Path;

use gpushare_utils::served_gpu;
use gpushare_utils::shm::Trust;

/// What the load did with `CUDA_VISIBLE_DEVICES`.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Pinned {
    /// The variable was set: kept as it is.
    AlreadySet,
    /// No pipe folder (`CUDA_MPS_PIPE_DIRECTORY` unset): the driver's
    /// default, which no node daemon names.
    NoPipeFolder,
    /// Set to the served GPU's UUID.
    To(String),
    /// The served GPU is not known: left unset.
    Unknown(String),
}

/// Sets `CUDA_VISIBLE_DEVICES` to the GPU the pipe folder's server serves
/// where it is unset; `trust`: who may own the file naming it.
///
/// # Safety
///
/// Changes the process environment: no other thread may read or write it
/// meanwhile. The constructor calls it before `main`, where only threads a
/// constructor of another library started could run.
pub(crate) unsafe fn pin_served_gpu(trust: &Trust) -> Pinned {
    if std::env::var_os("CUDA_VISIBLE_DEVICES").is_some() {
        return Pinned::AlreadySet;
    }
    let Some(pipe) = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").filter(|p| !p.is_empty()) else {
        return Pinned::NoPipeFolder;
    };
    match served_gpu::read_beside(Path::new(&pipe), trust) {
        Ok(uuid) => {
            // SAFETY: forwarded from the caller: nothing else touches the
            // environment now.
            unsafe { std::env::set_var("CUDA_VISIBLE_DEVICES", &uuid) };
            Pinned::To(uuid)
        }
        Err(error) => Pinned::Unknown(error.to_string()),
    }
}
