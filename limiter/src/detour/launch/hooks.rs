//! Launch detours and their adapters. Each `ptsz` declaration also makes the
//! `_ptsz` twin, with a detour of its own, so it forwards to the `_ptsz`
//! original. The adapters read what the caller's pointers hold (the launch
//! configuration) and hand `ops` typed values and the original as a closure.

use std::ffi::c_void;

use super::ops;
use crate::error::{LimiterError, Result};
use crate::sys::{CUfunction, CUgraphExec, CUlaunchConfig, CUresult, CUstream};

gpushare_macros::detours! {
    /// Every way to launch work on the GPU.
    pub static LAUNCH_DETOURS;

    /// The classic kernel launch.
    required ptsz fn cuLaunchKernel(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => launch_kernel;
    /// Kernel launch with attributes (what cudart uses for `<<<>>>` today).
    optional ptsz fn cuLaunchKernelEx(
        config: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => launch_kernel_ex;
    /// Cooperative kernel launch.
    optional ptsz fn cuLaunchCooperativeKernel(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
    ) -> CUresult => launch_cooperative;
    /// Graph launch.
    optional ptsz fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult
        => graph_launch;
    /// Legacy launch of a 1×1 grid.
    optional fn cuLaunch(f: CUfunction) -> CUresult => launch_legacy;
    /// Legacy grid launch.
    optional fn cuLaunchGrid(f: CUfunction, width: i32, height: i32) -> CUresult => launch_grid;
    /// Legacy asynchronous grid launch.
    optional fn cuLaunchGridAsync(f: CUfunction, width: i32, height: i32, stream: CUstream) -> CUresult
        => launch_grid_async;
}

/// The adapter of a grid launch whose arguments are the function, the grid,
/// the block, the shared memory, the stream and then `$rest` (`cuLaunchKernel`
/// and `cuLaunchCooperativeKernel` differ only there); `PER_THREAD` for the
/// `_ptsz` twin.
macro_rules! grid_adapter {
    ($name:ident, $symbol:ident, $($rest:ident),*) => {
        #[allow(clippy::too_many_arguments)]
        fn $name<const PER_THREAD: bool>(
            original: $symbol::Signature,
            f: CUfunction,
            grid_x: u32,
            grid_y: u32,
            grid_z: u32,
            block_x: u32,
            block_y: u32,
            block_z: u32,
            shared_mem_bytes: u32,
            stream: CUstream,
            $($rest: *mut *mut c_void),*
        ) -> Result<CUresult> {
            let (grid, block) = ([grid_x, grid_y, grid_z], [block_x, block_y, block_z]);
            // SAFETY: the caller's own arguments.
            let launch = || unsafe {
                original(f, grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_mem_bytes, stream, $($rest),*)
            };
            ops::kernel(f, grid, block, shared_mem_bytes, stream, PER_THREAD, launch)
        }
    };
}

grid_adapter!(launch_kernel, cuLaunchKernel, params, extra);
grid_adapter!(launch_cooperative, cuLaunchCooperativeKernel, params);

/// `cuLaunchKernelEx(_ptsz)`: the shape is in the caller's configuration.
fn launch_kernel_ex<const PER_THREAD: bool>(
    original: cuLaunchKernelEx::Signature,
    config: *const CUlaunchConfig,
    f: CUfunction,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<CUresult> {
    // SAFETY: the caller's launch configuration, null or valid for reads.
    let shape = unsafe { config.as_ref() }
        .copied()
        .ok_or(LimiterError::Bypass("no launch configuration"))?;
    let grid = [shape.gridDimX, shape.gridDimY, shape.gridDimZ];
    let block = [shape.blockDimX, shape.blockDimY, shape.blockDimZ];
    // SAFETY: the caller's own arguments.
    let launch = || unsafe { original(config, f, params, extra) };
    ops::kernel(
        f,
        grid,
        block,
        shape.sharedMemBytes,
        shape.hStream,
        PER_THREAD,
        launch,
    )
}

fn graph_launch<const PER_THREAD: bool>(
    original: cuGraphLaunch::Signature,
    exec: CUgraphExec,
    stream: CUstream,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    ops::graph(exec, stream, PER_THREAD, || unsafe {
        original(exec, stream)
    })
}

fn launch_legacy(original: cuLaunch::Signature, f: CUfunction) -> Result<CUresult> {
    // SAFETY: the caller's own argument.
    let launch = || unsafe { original(f) };
    ops::legacy(f, 1, 1, std::ptr::null_mut(), launch)
}

fn launch_grid(
    original: cuLaunchGrid::Signature,
    f: CUfunction,
    width: i32,
    height: i32,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let launch = || unsafe { original(f, width, height) };
    ops::legacy(f, width, height, std::ptr::null_mut(), launch)
}

fn launch_grid_async(
    original: cuLaunchGridAsync::Signature,
    f: CUfunction,
    width: i32,
    height: i32,
    stream: CUstream,
) -> Result<CUresult> {
    // SAFETY: the caller's own arguments.
    let launch = || unsafe { original(f, width, height, stream) };
    ops::legacy(f, width, height, stream, launch)
}
