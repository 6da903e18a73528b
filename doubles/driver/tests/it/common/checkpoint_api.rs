//! The double's `cuCheckpointProcess*` entry points, called from this test
//! process on another process (in the role of the node daemon).

use std::ffi::{c_int, c_uint};
use std::path::PathBuf;

use gpushare_examples::CHECKPOINT_DIR_VAR as DIR_VAR;

use super::in_process::Lib;
use super::{CUDA_SUCCESS, in_fresh_process};

/// `CUprocessState`.
pub(crate) const RUNNING: u32 = 0;
pub(crate) const LOCKED: u32 = 1;
pub(crate) const CHECKPOINTED: u32 = 2;

/// Runs the test `name` again in a fresh process (the test's own libcuda
/// reads the variable once) whose `GPUSHARE_DOUBLE_CHECKPOINT_DIR` names a
/// new folder under the target's temporary directory, removed afterwards;
/// in that child, the folder.
#[track_caller]
pub(crate) fn checkpoint_dir(name: &str) -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os(DIR_VAR) {
        assert!(
            in_fresh_process(name, &[]),
            "{DIR_VAR} is set outside the test"
        );
        return Some(dir.into());
    }
    let dir = tempfile::Builder::new()
        .prefix("checkpoint")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("a temporary folder");
    let path = dir.path().to_str().expect("a UTF-8 path");
    assert!(!in_fresh_process(name, &[(DIR_VAR, path)]));
    None
}

#[repr(C)]
#[derive(Default)]
pub(crate) struct LockArgs {
    pub(crate) timeout_ms: c_uint,
    pub(crate) reserved0: c_uint,
    pub(crate) reserved1: [u64; 7],
}

#[repr(C)]
pub(crate) struct GpuPair {
    pub(crate) old: [u8; 16],
    pub(crate) new: [u8; 16],
}

#[repr(C)]
pub(crate) struct RestoreArgs {
    pub(crate) pairs: *const GpuPair,
    pub(crate) count: c_uint,
    pub(crate) reserved: [u8; 44],
    pub(crate) reserved1: u64,
}

// The layouts of CUDA 13.0's cuda.h.
const _: () = assert!(size_of::<LockArgs>() == 64);
const _: () = assert!(size_of::<GpuPair>() == 32);
const _: () = assert!(size_of::<RestoreArgs>() == 64);

impl RestoreArgs {
    pub(crate) fn with(pairs: &[GpuPair]) -> RestoreArgs {
        RestoreArgs {
            pairs: pairs.as_ptr(),
            count: pairs.len() as c_uint,
            reserved: [0; 44],
            reserved1: 0,
        }
    }
}

pub(crate) type Opaque = std::ffi::c_void;

/// The double's checkpoint entry points, opened in this process.
pub(crate) struct Api {
    get_state: unsafe extern "C" fn(c_int, *mut u32) -> c_int,
    get_tid: unsafe extern "C" fn(c_int, *mut c_int) -> c_int,
    lock: unsafe extern "C" fn(c_int, *mut LockArgs) -> c_int,
    checkpoint: unsafe extern "C" fn(c_int, *mut Opaque) -> c_int,
    /// Raw, for arguments the methods do not make.
    pub(crate) restore: unsafe extern "C" fn(c_int, *mut RestoreArgs) -> c_int,
    unlock: unsafe extern "C" fn(c_int, *mut Opaque) -> c_int,
}

impl Api {
    pub(crate) fn open() -> Api {
        let lib = Lib::open("libcuda.so.1");
        // SAFETY: each field's type is the signature of the export in cuda.h
        // (the checkpoint and unlock arguments are passed NULL only).
        unsafe {
            Api {
                get_state: lib.function("cuCheckpointProcessGetState"),
                get_tid: lib.function("cuCheckpointProcessGetRestoreThreadId"),
                lock: lib.function("cuCheckpointProcessLock"),
                checkpoint: lib.function("cuCheckpointProcessCheckpoint"),
                restore: lib.function("cuCheckpointProcessRestore"),
                unlock: lib.function("cuCheckpointProcessUnlock"),
            }
        }
    }

    pub(crate) fn state(&self, pid: i32) -> Result<u32, c_int> {
        let mut state = u32::MAX;
        // SAFETY: a valid out-pointer.
        match unsafe { (self.get_state)(pid, &mut state) } {
            CUDA_SUCCESS => Ok(state),
            rc => Err(rc),
        }
    }

    pub(crate) fn tid(&self, pid: i32) -> Result<c_int, c_int> {
        let mut tid = -1;
        // SAFETY: a valid out-pointer.
        match unsafe { (self.get_tid)(pid, &mut tid) } {
            CUDA_SUCCESS => Ok(tid),
            rc => Err(rc),
        }
    }

    pub(crate) fn lock(&self, pid: i32) -> c_int {
        // SAFETY: NULL arguments are allowed.
        unsafe { (self.lock)(pid, std::ptr::null_mut()) }
    }

    pub(crate) fn lock_with(&self, pid: i32, mut args: LockArgs) -> c_int {
        // SAFETY: args lives across the call.
        unsafe { (self.lock)(pid, &mut args) }
    }

    pub(crate) fn checkpoint(&self, pid: i32) -> c_int {
        // SAFETY: NULL arguments are allowed.
        unsafe { (self.checkpoint)(pid, std::ptr::null_mut()) }
    }

    /// Lock, then checkpoint, both of which must succeed.
    pub(crate) fn park(&self, pid: i32) {
        assert_eq!(self.lock(pid), CUDA_SUCCESS);
        assert_eq!(self.checkpoint(pid), CUDA_SUCCESS);
    }

    pub(crate) fn restore(&self, pid: i32) -> c_int {
        // SAFETY: NULL arguments are allowed.
        unsafe { (self.restore)(pid, std::ptr::null_mut()) }
    }

    pub(crate) fn restore_onto(&self, pid: i32, pairs: &[GpuPair]) -> c_int {
        let mut args = RestoreArgs::with(pairs);
        // SAFETY: args and the pairs it points to live across the call.
        unsafe { (self.restore)(pid, &mut args) }
    }

    pub(crate) fn unlock(&self, pid: i32) -> c_int {
        // SAFETY: NULL arguments are allowed.
        unsafe { (self.unlock)(pid, std::ptr::null_mut()) }
    }
}

/// The UUID bytes of the double's GPU `gpu`.
pub(crate) fn uuid(gpu: u8) -> [u8; 16] {
    let mut bytes = [0u8; 16];
    for (i, byte) in bytes.iter_mut().take(15).enumerate() {
        *byte = 0x11 * (i as u8 + 1);
    }
    bytes[15] = gpu;
    bytes
}

/// (old, new) pairs of the double's GPU numbers, as UUID pairs.
pub(crate) fn pairs(gpus: &[(u8, u8)]) -> Vec<GpuPair> {
    gpus.iter()
        .map(|&(old, new)| GpuPair {
            old: uuid(old),
            new: uuid(new),
        })
        .collect()
}
