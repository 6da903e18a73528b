//! Launch logic: say what the launch runs, then let the throttle admit it.

use std::ffi::c_void;

use crate::error::{LimiterError, Result};
use crate::runtime;
use crate::sys::{CUfunction, CUgraphExec, CUlaunchConfig, CUresult, CUstream};
use crate::throttle::Work;
use crate::waves::Grid;

use super::hooks::{
    cuGraphLaunch, cuLaunch, cuLaunchCooperativeKernel, cuLaunchGrid, cuLaunchGridAsync,
    cuLaunchKernel, cuLaunchKernelEx,
};

/// Admits a launch of `work`; the one branch taken when no device has a
/// compute limit is the `Bypass` here.
#[inline(always)]
fn admit(
    work: impl FnOnce() -> Work,
    stream: CUstream,
    per_thread: bool,
    launch: impl FnOnce() -> CUresult,
) -> Result<CUresult> {
    let throttle = runtime::throttle().ok_or(LimiterError::Bypass("no compute limit"))?;
    throttle.launch(work(), stream, per_thread, launch)
}

fn kernel(f: CUfunction, grid: [u32; 3], block: [u32; 3], shared_bytes: u32) -> Work {
    Work::Kernel(Grid {
        function: f as usize,
        blocks: grid.iter().map(|&d| u64::from(d)).product(),
        threads: block.iter().product::<u32>(),
        shared_bytes,
    })
}

/// `cuLaunchKernel(_ptsz)`; `PER_THREAD` for the `_ptsz` twin.
#[allow(clippy::too_many_arguments)]
pub fn launch_kernel<const PER_THREAD: bool>(
    original: cuLaunchKernel::Signature,
    f: CUfunction,
    grid_x: u32,
    grid_y: u32,
    grid_z: u32,
    block_x: u32,
    block_y: u32,
    block_z: u32,
    shared_mem_bytes: u32,
    stream: CUstream,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<CUresult> {
    let (grid, block) = ([grid_x, grid_y, grid_z], [block_x, block_y, block_z]);
    admit(
        || kernel(f, grid, block, shared_mem_bytes),
        stream,
        PER_THREAD,
        || {
            // SAFETY: the caller's own arguments.
            unsafe {
                original(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    params,
                    extra,
                )
            }
        },
    )
}

/// `cuLaunchKernelEx(_ptsz)`; `PER_THREAD` for the `_ptsz` twin.
pub fn launch_kernel_ex<const PER_THREAD: bool>(
    original: cuLaunchKernelEx::Signature,
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<CUresult> {
    // SAFETY: the caller's launch configuration, read only.
    let shape = unsafe { config.as_ref() }
        .copied()
        .ok_or(LimiterError::Bypass("no launch configuration"))?;
    let grid = [shape.gridDimX, shape.gridDimY, shape.gridDimZ];
    let block = [shape.blockDimX, shape.blockDimY, shape.blockDimZ];
    admit(
        || kernel(f, grid, block, shape.sharedMemBytes),
        shape.hStream,
        PER_THREAD,
        || {
            // SAFETY: the caller's own arguments.
            unsafe { original(config, f, params, extra) }
        },
    )
}

/// `cuLaunchCooperativeKernel(_ptsz)`; `PER_THREAD` for the `_ptsz` twin.
#[allow(clippy::too_many_arguments)]
pub fn launch_cooperative<const PER_THREAD: bool>(
    original: cuLaunchCooperativeKernel::Signature,
    f: CUfunction,
    grid_x: u32,
    grid_y: u32,
    grid_z: u32,
    block_x: u32,
    block_y: u32,
    block_z: u32,
    shared_mem_bytes: u32,
    stream: CUstream,
    params: *mut *mut c_void,
) -> Result<CUresult> {
    let (grid, block) = ([grid_x, grid_y, grid_z], [block_x, block_y, block_z]);
    admit(
        || kernel(f, grid, block, shared_mem_bytes),
        stream,
        PER_THREAD,
        || {
            // SAFETY: the caller's own arguments.
            unsafe {
                original(
                    f,
                    grid_x,
                    grid_y,
                    grid_z,
                    block_x,
                    block_y,
                    block_z,
                    shared_mem_bytes,
                    stream,
                    params,
                )
            }
        },
    )
}

/// `cuGraphLaunch(_ptsz)`; `PER_THREAD` for the `_ptsz` twin.
pub fn graph_launch<const PER_THREAD: bool>(
    original: cuGraphLaunch::Signature,
    exec: CUgraphExec,
    stream: CUstream,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    admit(
        || Work::Graph(exec as usize),
        stream,
        PER_THREAD,
        || unsafe { original(exec, stream) },
    )
}

pub fn launch_legacy(original: cuLaunch::Signature, f: CUfunction) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    admit(
        || kernel(f, [1, 1, 1], [1, 1, 1], 0),
        std::ptr::null_mut(),
        false,
        || unsafe { original(f) },
    )
}

fn legacy_grid(width: i32, height: i32) -> [u32; 3] {
    [width.max(0) as u32, height.max(0) as u32, 1]
}

pub fn launch_grid(
    original: cuLaunchGrid::Signature,
    f: CUfunction,
    width: i32,
    height: i32,
) -> Result<CUresult> {
    let grid = legacy_grid(width, height);
    // SAFETY: the caller's own arguments.
    admit(
        || kernel(f, grid, [1, 1, 1], 0),
        std::ptr::null_mut(),
        false,
        || unsafe { original(f, width, height) },
    )
}

pub fn launch_grid_async(
    original: cuLaunchGridAsync::Signature,
    f: CUfunction,
    width: i32,
    height: i32,
    stream: CUstream,
) -> Result<CUresult> {
    let grid = legacy_grid(width, height);
    // SAFETY: the caller's own arguments.
    admit(
        || kernel(f, grid, [1, 1, 1], 0),
        stream,
        false,
        || unsafe { original(f, width, height, stream) },
    )
}
