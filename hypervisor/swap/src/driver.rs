//! The driver's checkpoint API (`cuCheckpointProcess*`, CUDA 12.8 and
//! later), loaded at run time from `libcuda.so.1` and called on other
//! processes by pid.
//!
//! Measured on H100 and H200 (driver 580): lock takes under a millisecond
//! and blocks every CUDA call of the process inside the driver until
//! unlock; checkpoint moves the process's device memory to its host memory
//! (about 2 GiB/s), restore brings it back (5–6.5 GiB/s), onto other GPUs
//! when the GPU pairs say so. The process keeps its device numbering.

use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

/// The driver's state of a process (`CUprocessState`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    /// Calls run.
    Running,
    /// Calls block until unlock.
    Locked,
    /// Its device memory is in host memory (and it is locked).
    Checkpointed,
    /// A checkpoint or restore failed half-way.
    Failed,
}

/// A GPU UUID as the driver writes it (`CUuuid`: 16 bytes).
pub type RawUuid = [u8; 16];

/// Why a checkpoint call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// The driver library could not be loaded.
    #[error("cannot load {library}: {reason}")]
    Load {
        /// The library's name or path.
        library: String,
        /// `dlerror`'s words.
        reason: String,
    },
    /// The driver is older than the checkpoint API.
    #[error("the driver has no {symbol} (the checkpoint API needs driver 550 or later)")]
    Missing {
        /// The symbol not found.
        symbol: &'static str,
    },
    /// The driver refused a call.
    #[error("{call}(pid {pid}): {name} ({code})")]
    Call {
        /// The entry point.
        call: &'static str,
        /// The process it was called on.
        pid: u32,
        /// The `CUresult`.
        code: i32,
        /// Its name (`cuGetErrorName`).
        name: String,
    },
    /// A GPU UUID could not be read as 16 hexadecimal bytes.
    #[error("not a GPU UUID: {0:?}")]
    Uuid(String),
}

type CuInit = unsafe extern "C" fn(c_uint) -> c_int;
type CuErrorName = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
type CuState = unsafe extern "C" fn(c_int, *mut c_int) -> c_int;
type CuOp = unsafe extern "C" fn(c_int, *mut c_void) -> c_int;

/// `CUcheckpointLockArgs` (64 bytes).
#[repr(C)]
struct LockArgs {
    timeout_ms: c_uint,
    reserved0: c_uint,
    reserved1: [u64; 7],
}

/// `CUcheckpointGpuPair`.
#[repr(C)]
struct GpuPair {
    old: RawUuid,
    new: RawUuid,
}

/// `CUcheckpointRestoreArgs` (64 bytes).
#[repr(C)]
struct RestoreArgs {
    gpu_pairs: *mut GpuPair,
    gpu_pairs_count: c_uint,
    reserved: [c_char; 44],
    reserved1: u64,
}

const _: () = {
    assert!(size_of::<LockArgs>() == 64);
    assert!(size_of::<RestoreArgs>() == 64);
    assert!(size_of::<GpuPair>() == 32);
};

/// The checkpoint API of the loaded driver.
pub struct CheckpointDriver {
    library: String,
    state: CuState,
    lock: CuOp,
    checkpoint: CuOp,
    restore: CuOp,
    unlock: CuOp,
    error_name: Option<CuErrorName>,
}

impl std::fmt::Debug for CheckpointDriver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CheckpointDriver")
            .field("library", &self.library)
            .finish_non_exhaustive()
    }
}

impl CheckpointDriver {
    /// Loads `library` (`libcuda.so.1` on a node), initialises the driver
    /// (no context is made) and finds the checkpoint entry points.
    pub fn load(library: &str) -> Result<Self, DriverError> {
        let name = CString::new(library).map_err(|_| DriverError::Load {
            library: library.to_owned(),
            reason: "a NUL byte in the name".into(),
        })?;
        // SAFETY: `name` is a valid C string; the handle is kept for the
        // life of the process (never closed), so the symbols stay valid.
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            return Err(DriverError::Load {
                library: library.to_owned(),
                reason: dl_error(),
            });
        }
        let find = |symbol: &'static str| -> Result<*mut c_void, DriverError> {
            let c = CString::new(symbol).map_err(|_| DriverError::Missing { symbol })?;
            // SAFETY: `handle` is a live handle and `c` a valid C string.
            let found = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if found.is_null() {
                Err(DriverError::Missing { symbol })
            } else {
                Ok(found)
            }
        };
        // SAFETY: each symbol is the driver's exported function of exactly
        // the signature given (cuda.h, CUDA 12.8 and later).
        let driver = unsafe {
            let init: CuInit = std::mem::transmute::<*mut c_void, CuInit>(find("cuInit")?);
            let error_name = find("cuGetErrorName")
                .ok()
                .map(|p| std::mem::transmute::<*mut c_void, CuErrorName>(p));
            let driver = Self {
                library: library.to_owned(),
                state: std::mem::transmute::<*mut c_void, CuState>(find(
                    "cuCheckpointProcessGetState",
                )?),
                lock: std::mem::transmute::<*mut c_void, CuOp>(find("cuCheckpointProcessLock")?),
                checkpoint: std::mem::transmute::<*mut c_void, CuOp>(find(
                    "cuCheckpointProcessCheckpoint",
                )?),
                restore: std::mem::transmute::<*mut c_void, CuOp>(find(
                    "cuCheckpointProcessRestore",
                )?),
                unlock: std::mem::transmute::<*mut c_void, CuOp>(find(
                    "cuCheckpointProcessUnlock",
                )?),
                error_name,
            };
            let code = init(0);
            if code != 0 {
                return Err(driver.error("cuInit", 0, code));
            }
            driver
        };
        Ok(driver)
    }

    /// The library loaded.
    pub fn library(&self) -> &str {
        &self.library
    }

    /// The driver's state of process `pid`.
    pub fn state(&self, pid: u32) -> Result<ProcessState, DriverError> {
        let mut state: c_int = 0;
        // SAFETY: the entry point writes one `CUprocessState` (an int).
        let code = unsafe { (self.state)(pid_arg(pid), &mut state) };
        if code != 0 {
            return Err(self.error("cuCheckpointProcessGetState", pid, code));
        }
        Ok(match state {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            _ => ProcessState::Failed,
        })
    }

    /// Blocks `pid`'s CUDA calls; fails after `timeout_ms` (0: no bound)
    /// if its submitted work does not finish.
    pub fn lock(&self, pid: u32, timeout_ms: u32) -> Result<(), DriverError> {
        let mut args = LockArgs {
            timeout_ms,
            reserved0: 0,
            reserved1: [0; 7],
        };
        // SAFETY: `args` is a live CUcheckpointLockArgs for the call.
        let code = unsafe { (self.lock)(pid_arg(pid), (&raw mut args).cast()) };
        self.check("cuCheckpointProcessLock", pid, code)
    }

    /// Moves the locked `pid`'s device memory to host memory.
    pub fn checkpoint(&self, pid: u32) -> Result<(), DriverError> {
        // SAFETY: NULL arguments are the documented default.
        let code = unsafe { (self.checkpoint)(pid_arg(pid), std::ptr::null_mut()) };
        self.check("cuCheckpointProcessCheckpoint", pid, code)
    }

    /// Brings the checkpointed `pid` back, each GPU of `pairs` onto its
    /// partner (none: onto the GPUs it ran on).
    pub fn restore(&self, pid: u32, pairs: &[(RawUuid, RawUuid)]) -> Result<(), DriverError> {
        let mut pairs: Vec<GpuPair> = pairs
            .iter()
            .map(|(old, new)| GpuPair {
                old: *old,
                new: *new,
            })
            .collect();
        let mut args = RestoreArgs {
            gpu_pairs: if pairs.is_empty() {
                std::ptr::null_mut()
            } else {
                pairs.as_mut_ptr()
            },
            gpu_pairs_count: c_uint::try_from(pairs.len()).unwrap_or(c_uint::MAX),
            reserved: [0; 44],
            reserved1: 0,
        };
        let args_ptr: *mut c_void = if pairs.is_empty() {
            std::ptr::null_mut()
        } else {
            (&raw mut args).cast()
        };
        // SAFETY: `args` (and the pairs it points at) live through the call.
        let code = unsafe { (self.restore)(pid_arg(pid), args_ptr) };
        self.check("cuCheckpointProcessRestore", pid, code)
    }

    /// Lets the restored (or never checkpointed) `pid`'s calls go on.
    pub fn unlock(&self, pid: u32) -> Result<(), DriverError> {
        // SAFETY: NULL arguments are the documented default.
        let code = unsafe { (self.unlock)(pid_arg(pid), std::ptr::null_mut()) };
        self.check("cuCheckpointProcessUnlock", pid, code)
    }

    fn check(&self, call: &'static str, pid: u32, code: c_int) -> Result<(), DriverError> {
        if code == 0 {
            Ok(())
        } else {
            Err(self.error(call, pid, code))
        }
    }

    fn error(&self, call: &'static str, pid: u32, code: c_int) -> DriverError {
        let mut name: *const c_char = std::ptr::null();
        let named = self.error_name.is_some_and(|f| {
            // SAFETY: the entry point writes a pointer to a static string.
            unsafe { f(code, &mut name) == 0 && !name.is_null() }
        });
        let name = if named {
            // SAFETY: the driver's error names are static NUL-terminated strings.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            "CUDA_ERROR".to_owned()
        };
        DriverError::Call {
            call,
            pid,
            code,
            name,
        }
    }
}

// SAFETY: the struct holds function pointers into a library that is never
// unloaded; the driver's entry points may be called from any thread.
unsafe impl Send for CheckpointDriver {}
// SAFETY: as above; calling them concurrently is the driver's to serialise.
unsafe impl Sync for CheckpointDriver {}

fn pid_arg(pid: u32) -> c_int {
    c_int::try_from(pid).unwrap_or(c_int::MAX)
}

fn dl_error() -> String {
    // SAFETY: dlerror returns NULL or a thread-local NUL-terminated string.
    let text = unsafe { libc::dlerror() };
    if text.is_null() {
        "unknown error".to_owned()
    } else {
        // SAFETY: non-NULL, NUL-terminated (above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }
}

/// `GPU-xxxxxxxx-xxxx-…` (or bare hex) as the driver's 16 bytes.
pub fn parse_uuid(uuid: &str) -> Result<RawUuid, DriverError> {
    let hex: String = uuid
        .trim()
        .trim_start_matches("GPU-")
        .chars()
        .filter(|c| *c != '-')
        .collect();
    let bad = || DriverError::Uuid(uuid.to_owned());
    if hex.len() != 32 {
        return Err(bad());
    }
    let mut raw = [0u8; 16];
    for (i, byte) in raw.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2).ok_or_else(bad)?, 16)
            .map_err(|_| bad())?;
    }
    Ok(raw)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_read_as_the_driver_writes_them() {
        let raw = parse_uuid("GPU-0a1b2c3d-0000-1111-2222-333344445555").expect("uuid");
        assert_eq!(raw[0], 0x0a);
        assert_eq!(raw[3], 0x3d);
        assert_eq!(raw[15], 0x55);
        assert!(parse_uuid("GPU-12").is_err());
        assert!(parse_uuid("GPU-zz1b2c3d-0000-1111-2222-333344445555").is_err());
    }

    #[test]
    fn a_missing_library_is_named() {
        let error = CheckpointDriver::load("/nonexistent/libcuda.so.1").expect_err("no library");
        assert!(
            error.to_string().contains("/nonexistent/libcuda.so.1"),
            "{error}"
        );
    }
}
