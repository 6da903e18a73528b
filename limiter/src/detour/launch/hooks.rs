//! Launch detours and their adapters. Each `ptsz` declaration also makes the
//! `_ptsz` twin, with a detour of its own, so it forwards to the `_ptsz`
//! original. The handlers are `around` ones: an adapter reads what the
//! caller's pointers hold (the launch configuration) and hands `ops` typed
//! values; the detour then makes the launch itself, from its own frame, and
//! gives the admitted launch the driver's result. A kernel launch the GPU
//! had no room for is made once more once the hypervisor made room
//! ([`ops::again`]).

use std::ffi::c_void;

use super::ops;
use crate::error::{LimiterError, Pass, Result};
use crate::sys::{CUfunction, CUgraphExec, CUlaunchConfig, CUresult, CUstream};
use crate::throttle::Admitted;

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
    ) -> CUresult => around launch_kernel, again ops::again;
    /// Kernel launch with attributes (what cudart uses for `<<<>>>` today).
    optional ptsz fn cuLaunchKernelEx(
        config: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => around launch_kernel_ex, again ops::again;
    /// Cooperative kernel launch.
    optional ptsz fn cuLaunchCooperativeKernel(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
    ) -> CUresult => around launch_cooperative, again ops::again;
    /// Graph launch.
    optional ptsz fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult
        => around graph_launch;
    /// Legacy launch of a 1×1 grid.
    optional fn cuLaunch(f: CUfunction) -> CUresult => around launch_legacy;
    /// Legacy grid launch.
    optional fn cuLaunchGrid(f: CUfunction, width: i32, height: i32) -> CUresult
        => around launch_grid;
    /// Legacy asynchronous grid launch.
    optional fn cuLaunchGridAsync(f: CUfunction, width: i32, height: i32, stream: CUstream) -> CUresult
        => around launch_grid_async;
}

/// The adapter of a grid launch whose arguments are the function, the grid,
/// the block, the shared memory, the stream and then `$rest` (`cuLaunchKernel`
/// and `cuLaunchCooperativeKernel` differ only there, which the driver reads);
/// `PER_THREAD` for the `_ptsz` twin.
macro_rules! grid_adapter {
    ($name:ident, $($rest:ident),*) => {
        #[allow(clippy::too_many_arguments)]
        fn $name<const PER_THREAD: bool>(
            f: CUfunction,
            grid_x: u32,
            grid_y: u32,
            grid_z: u32,
            block_x: u32,
            block_y: u32,
            block_z: u32,
            shared_mem_bytes: u32,
            stream: CUstream,
            $(_: $rest),*
        ) -> Result<Admitted> {
            let (grid, block) = ([grid_x, grid_y, grid_z], [block_x, block_y, block_z]);
            ops::kernel(f, grid, block, shared_mem_bytes, stream, PER_THREAD)
        }
    };
}

grid_adapter!(launch_kernel, Params, Params);
grid_adapter!(launch_cooperative, Params);

/// The kernel arguments, which only the driver reads.
type Params = *mut *mut c_void;

/// `cuLaunchKernelEx(_ptsz)`: the shape is in the caller's configuration.
fn launch_kernel_ex<const PER_THREAD: bool>(
    config: *const CUlaunchConfig,
    f: CUfunction,
    _params: Params,
    _extra: Params,
) -> Result<Admitted> {
    // SAFETY: the caller's launch configuration, null or valid for reads.
    let shape = unsafe { config.as_ref() }
        .copied()
        .ok_or(LimiterError::Bypass(Pass::NoLaunchConfiguration))?;
    let grid = [shape.gridDimX, shape.gridDimY, shape.gridDimZ];
    let block = [shape.blockDimX, shape.blockDimY, shape.blockDimZ];
    ops::kernel(
        f,
        grid,
        block,
        shape.sharedMemBytes,
        shape.hStream,
        PER_THREAD,
    )
}

fn graph_launch<const PER_THREAD: bool>(exec: CUgraphExec, stream: CUstream) -> Result<Admitted> {
    ops::graph(exec, stream, PER_THREAD)
}

fn launch_legacy(f: CUfunction) -> Result<Admitted> {
    ops::legacy(f, 1, 1, std::ptr::null_mut())
}

fn launch_grid(f: CUfunction, width: i32, height: i32) -> Result<Admitted> {
    ops::legacy(f, width, height, std::ptr::null_mut())
}

fn launch_grid_async(f: CUfunction, width: i32, height: i32, stream: CUstream) -> Result<Admitted> {
    ops::legacy(f, width, height, stream)
}
