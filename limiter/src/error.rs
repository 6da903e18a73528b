//! The limiter's typed outcome of a detour, converted once into what the
//! caller sees (`CUresult` or `nvmlReturn_t`).

use gpushare_hook::{Disposition, IntoReturn};

use crate::sys::{CUresult, nvmlReturn_t};

/// Why a detour leaves a call to the driver as it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Pass {
    /// A null out-pointer: the driver answers it.
    #[error("a null out-pointer: the driver answers it")]
    NullOutPointer,
    /// The limiter is off in this process.
    #[error("the limiter is off in this process")]
    LimitsOff,
    /// The device has no limit.
    #[error("the device has no limit")]
    DeviceUnlimited,
    /// No current context.
    #[error("no current context")]
    NoCurrentContext,
    /// The driver's own functions are not resolved.
    #[error("the driver's own functions are not resolved")]
    DriverNotResolved,
    /// A device index out of range.
    #[error("a device index out of range")]
    BadDevice,
    /// No compute limit.
    #[error("no compute limit")]
    NoComputeLimit,
    /// An allocation of nothing.
    #[error("an allocation of nothing")]
    EmptyAllocation,
    /// The driver refused the call.
    #[error("the driver refused the call")]
    DriverRefused,
    /// Captured into a graph: the graph's launch is admitted.
    #[error("captured into a graph: the graph's launch is admitted")]
    Captured,
    /// The benchmark switched the admission off.
    #[cfg(feature = "launch-ab")]
    #[error("the benchmark switched the admission off")]
    AbSwitchedOff,
    /// A size that overflows.
    #[error("a size that overflows")]
    SizeOverflows,
    /// Nothing to reserve.
    #[error("nothing to reserve")]
    NothingToReserve,
    /// Not charged by the limiter.
    #[error("not charged by the limiter")]
    NotCharged,
    /// Not a library's kernel.
    #[error("not a library's kernel")]
    NotLibraryKernel,
    /// No allocation properties.
    #[error("no allocation properties")]
    NoProperties,
    /// No launch configuration.
    #[error("no launch configuration")]
    NoLaunchConfiguration,
    /// No device index.
    #[error("no device index")]
    NoIndex,
    /// No hypervisor to wait for.
    #[error("no hypervisor to wait for")]
    NoHypervisor,
    /// No array descriptor.
    #[error("no array descriptor")]
    NoDescriptor,
    /// A graph without allocation nodes.
    #[error("a graph without allocation nodes")]
    NoAllocationNodes,
    /// No device UUID.
    #[error("no device UUID")]
    NoUuid,
    /// Host memory, not the device's.
    #[error("host memory, not the device's")]
    HostMemory,
    /// A graph the driver cannot walk: its own to refuse.
    #[error("a graph the driver cannot walk: its own to refuse")]
    GraphNotWalked,
    /// A context limit that holds no memory.
    #[error("a context limit that holds no memory")]
    LimitHoldsNoMemory,
    /// A context of this process is charged already.
    #[error("a context of this process is charged already")]
    ContextCharged,
    /// NVML is not resolved.
    #[error("NVML is not resolved")]
    NvmlUnresolved,
    /// Memory the limiter does not back: the driver knows it.
    #[error("memory the limiter does not back: the driver knows it")]
    NotBacked,
    /// The driver answers this query of backed memory.
    #[error("the driver answers this query of backed memory")]
    DriverAnswers,
}

/// Why a detour did not simply return the driver's answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LimiterError {
    /// Nothing for the limiter to do here; the original runs unchanged.
    #[error("pass through: {0}")]
    Bypass(Pass),
    /// The allocation would take the pod over its quota on this device.
    #[error("device {device}: {requested} bytes requested, {used} of {quota} in use by the pod")]
    OverQuota {
        device: usize,
        requested: u64,
        used: u64,
        quota: u64,
    },
    /// The pod's ledger is unusable, so no allocation can be accounted.
    #[error("pod ledger unavailable")]
    LedgerUnavailable,
    /// The configuration is broken: CUDA must not run without its limits.
    #[error("refusing CUDA: {0}")]
    Misconfigured(&'static str),
    /// A pointer argument the driver requires was null.
    #[error("null argument")]
    NullArgument,
}

impl IntoReturn<CUresult> for LimiterError {
    fn into_return(self) -> Disposition<CUresult> {
        match self {
            Self::Bypass(_) => Disposition::CallOriginal,
            Self::OverQuota { .. } | Self::LedgerUnavailable => {
                Disposition::Return(CUresult::ERROR_OUT_OF_MEMORY)
            }
            Self::Misconfigured(_) => Disposition::Return(CUresult::ERROR_NOT_INITIALIZED),
            Self::NullArgument => Disposition::Return(CUresult::ERROR_INVALID_VALUE),
        }
    }
}

impl IntoReturn<nvmlReturn_t> for LimiterError {
    fn into_return(self) -> Disposition<nvmlReturn_t> {
        match self {
            Self::NullArgument => Disposition::Return(nvmlReturn_t::ERROR_INVALID_ARGUMENT),
            // NVML only reports; anything else leaves the real answer alone.
            _ => Disposition::CallOriginal,
        }
    }
}

/// What detour logic returns.
pub(crate) type Result<T, E = LimiterError> = std::result::Result<T, E>;
