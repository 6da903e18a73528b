//! Launch detours: declarations only; the logic is in `ops`. Each `_ptsz`
//! twin has its own detour, so it forwards to the `_ptsz` original.

use std::ffi::c_void;

use super::ops;
use crate::sys::{CUfunction, CUgraphExec, CUlaunchConfig, CUresult, CUstream};

gpushare_macros::detours! {
    /// Every way to launch work on the GPU.
    pub static LAUNCH_DETOURS;

    /// The classic kernel launch.
    required fn cuLaunchKernel(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => ops::launch_kernel::<false>;
    /// The classic kernel launch, per-thread default stream.
    optional fn cuLaunchKernel_ptsz(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => ops::launch_kernel::<true>;
    /// Kernel launch with attributes (what cudart uses for `<<<>>>` today).
    optional fn cuLaunchKernelEx(
        config: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => ops::launch_kernel_ex::<false>;
    /// Kernel launch with attributes, per-thread default stream.
    optional fn cuLaunchKernelEx_ptsz(
        config: *const CUlaunchConfig,
        f: CUfunction,
        params: *mut *mut c_void,
        extra: *mut *mut c_void,
    ) -> CUresult => ops::launch_kernel_ex::<true>;
    /// Cooperative kernel launch.
    optional fn cuLaunchCooperativeKernel(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
    ) -> CUresult => ops::launch_cooperative::<false>;
    /// Cooperative kernel launch, per-thread default stream.
    optional fn cuLaunchCooperativeKernel_ptsz(
        f: CUfunction,
        grid_x: u32, grid_y: u32, grid_z: u32,
        block_x: u32, block_y: u32, block_z: u32,
        shared_mem_bytes: u32,
        stream: CUstream,
        params: *mut *mut c_void,
    ) -> CUresult => ops::launch_cooperative::<true>;
    /// Graph launch.
    optional fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult => ops::graph_launch::<false>;
    /// Graph launch, per-thread default stream.
    optional fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult
        => ops::graph_launch::<true>;
    /// Legacy launch of a 1×1 grid.
    optional fn cuLaunch(f: CUfunction) -> CUresult => ops::launch_legacy;
    /// Legacy grid launch.
    optional fn cuLaunchGrid(f: CUfunction, width: i32, height: i32) -> CUresult => ops::launch_grid;
    /// Legacy asynchronous grid launch.
    optional fn cuLaunchGridAsync(f: CUfunction, width: i32, height: i32, stream: CUstream) -> CUresult
        => ops::launch_grid_async;
}
