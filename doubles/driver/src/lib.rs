//! Demos of the limiter, and the test double of the driver that CI tests it against.
//!
//! No GPU and no CUDA toolkit are needed: `build.rs` compiles, with the
//! system C compiler, a fake `libcuda.so.1` and `libnvidia-ml.so.1` whose
//! exported entry points begin with the bytes measured on an H100 (driver
//! 580.159.04), and two probe programs that reach them. A test then:
//!
//! 1. starts [`program`]`("cudaprobe")` (or `cudaprobe_linked`) with
//!    `LD_LIBRARY_PATH` = [`double_dir`] ([`command`] does both) and, for the
//!    limiter, `LD_PRELOAD` = the limiter;
//! 2. the limiter's constructor finds the double mapped and inline-patches its
//!    entry points, exactly as it would the real driver's: every `cu*` starts
//!    with [`CU_PROLOGUE`], a RIP-relative `cmp` at byte 10;
//!    `nvmlDeviceGetMemoryInfo(_v2)` with [`NVML_MEMINFO_PROLOGUE`];
//!    `nvmlInit_v2` is the 7-byte [`NVML_INIT_V2_PREFIX`] `+ rel32`, followed
//!    directly by `nvmlShutdown`;
//! 3. the probe runs its command script, one line of output per command
//!    (format in `programs/cudaprobe.c`), which the test compares.
//!
//! # The fake GPUs
//!
//! Set by environment variables read once per process:
//! `GPUSHARE_DOUBLE_DEVICES` (0..8, default 1), `GPUSHARE_DOUBLE_TOTAL`
//! (bytes per GPU, plain or with a binary `k/m/g/t` suffix, default
//! [`DEFAULT_TOTAL`]), `GPUSHARE_DOUBLE_CONTEXT_BYTES` (the driver's own memory,
//! charged to the process by each live context on a GPU, default
//! [`DEFAULT_CONTEXT_BYTES`]). Allocations are charged their exact size
//! (pitch: width rounded up to 512 × height; arrays: element × W × max(H,1) ×
//! max(D,1), mipmaps summed over the levels), fail with
//! `CUDA_ERROR_OUT_OF_MEMORY` when they do not fit, and free gives back.
//! The virtual memory management API is modelled whole (`double/vmm.c`):
//! memory made by `cuMemCreate` is charged until its last reference and
//! mapping go, and a range mapped with `cuMemMap` and made accessible with
//! `cuMemSetAccess` holds real bytes that copies and sets move, so a test
//! can check contents; `GPUSHARE_DOUBLE_FAIL_VMM` makes named calls fail.
//! Memory created with `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR` keeps its
//! bytes in a memfd: `cuMemExportToShareableHandle` gives a descriptor of it
//! that `cuMemImportFromShareableHandle`, in this process or another, turns
//! into memory over the same bytes, charged to the exporter only. Legacy IPC
//! is not modelled: `cuIpcGetMemHandle` answers `CUDA_ERROR_NOT_SUPPORTED`
//! (`CUDA_ERROR_INVALID_VALUE` for VMM memory, as the real driver refuses
//! it), `cuIpcOpenMemHandle(_v2)` and `cuIpcCloseMemHandle`
//! `CUDA_ERROR_INVALID_VALUE`.
//! Memory the real driver takes without an allocation call is modelled too,
//! and counted the same way: context limits above their defaults
//! (`cuCtxSetLimit`), module globals (an image that begins
//! `gpushare-double-module globals=N`; for a fat binary given to
//! `cuLibraryLoadData`, its cubin's `.nv.global*` sections, taken at the
//! library's first use in each context), graph memory (reserved at a graph
//! exec's first upload or launch, retained after it until
//! `cuDeviceGraphMemTrim`) and what pools retain (each GPU's default pool
//! and those `cuMemPoolCreate` makes: freed bytes kept by a release
//! threshold, released at synchronize, `cuMemPoolTrimTo` or
//! `cuMemPoolDestroy`; a freed block is reused by an allocation it holds).
//! `cuMemGetInfo` and NVML report this process's usage only (NVML's memory
//! info the node's, with a node file: below). Device `i` has
//! the UUID [`uuid`]`(i)`. `CUDA_VISIBLE_DEVICES` (indices, or UUIDs as the device plugin and CDI
//! specs give them) renumbers
//! the CUDA side as the real driver does (CUDA device `k` is the `k`-th
//! listed GPU, with its UUID); NVML still sees every GPU by its own index. `cuGetProcAddress(_v2)` hands out the exported
//! addresses (`cuMemAlloc` → `cuMemAlloc_v2`, with the per-thread flag
//! `cuMemAllocAsync` → `cuMemAllocAsync_ptsz`, …) like the real driver.
//! MPS: the first `cuInit` makes the process an MPS client when
//! `CUDA_MPS_PIPE_DIRECTORY` names a folder whose `control` Unix socket
//! accepts a connection (the MPS control daemon is up), and
//! `cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MPS_ENABLED = 133)` then
//! answers 1 on every device. Its CUDA devices are then the GPUs the MPS
//! server serves, as the real driver's are: those the fake control daemon
//! (`mps-fake`) names in `fake-served-devices` in the pipe folder (its own
//! `CUDA_VISIBLE_DEVICES`; no file: every GPU), narrowed by the client's
//! `CUDA_VISIBLE_DEVICES` (UUIDs among them, or indices into their list);
//! NVML still sees every GPU. Otherwise (unset, no socket, nobody
//! listening: no daemon, no MPS) it answers 0, as the real driver does when
//! it falls back to running without MPS. The driver's default folder
//! (`/tmp/nvidia-mps`) is never looked at.
//! The sources in `double/` say the rest.
//!
//! # The simulated GPU clock
//!
//! Kernels run nowhere, but they take time: each device of a process has one
//! timeline (`CLOCK_MONOTONIC` ns), and every launch — `cuLaunchKernel(_ptsz)`,
//! `cuLaunchKernelEx(_ptsz)`, `cuLaunchCooperativeKernel(_ptsz)`,
//! `cuGraphLaunch(_ptsz)`, legacy `cuLaunch`/`cuLaunchGrid(Async)` — returns at
//! once and occupies it from `max(now, busy_until)` for its duration, as
//! kernels that fill every SM would. A kernel lasts
//! `*(kernelParams[0] as *const u64)` ns; without `kernelParams`, and always
//! for the legacy launches, `GPUSHARE_DOUBLE_KERNEL_NS` (default
//! [`DEFAULT_KERNEL_NS`]). A launch blocks only while
//! `GPUSHARE_DOUBLE_QUEUE_DEPTH` (default [`DEFAULT_QUEUE_DEPTH`])
//! submissions are pending on the device, like a full launch queue. Stream
//! capture records launches into the graph without running them; a graph
//! launch occupies the sum of its captured kernels. `cuEventRecord` stamps
//! `max(now, busy_until)`, and the next kernel on the device takes
//! `GPUSHARE_DOUBLE_EVENT_RAMP_NS` (default 0) longer: a real kernel's launch
//! ramp overlaps the kernel before it, except after an event; `cuEventQuery`, `cuEventSynchronize`,
//! `cuEventElapsedTime(_v2)`, `cuStreamQuery`, `cuStreamSynchronize(_ptsz)`
//! and `cuCtxSynchronize` follow that clock (`CUDA_ERROR_NOT_READY` until
//! then). During a capture the double enforces the rules measured on driver
//! 580: an event or stream query/synchronize fails with
//! `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates a capture begun in
//! GLOBAL mode (from any thread) or THREAD_LOCAL mode (from its own thread),
//! unless the calling thread switched itself to RELAXED with
//! `cuThreadExchangeStreamCaptureMode`; `cuCtxSynchronize` and waiting for
//! the capturing stream always do. `cuEventRecord`, `cuEventElapsedTime` and
//! launches are safe. A limiter that meters kernels must respect this, or it
//! breaks the application's CUDA graphs. `cuStreamGetCtx(_ptsz)` gives a
//! created stream's context (the current one for the default streams).
//!
//! Copies and sets (`cuMemcpy*`, `cuMemsetD8/D32*`, with their `_ptds` /
//! `_ptsz` variants) move nothing and take no simulated time: they check the
//! context, the stream and that the device range lies in a live allocation
//! (`CUDA_ERROR_INVALID_VALUE` otherwise). `cuStreamWaitEvent(_ptsz)` checks
//! its handles only.
//!
//! # Checkpoints
//!
//! `cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock,GetState,GetRestoreThreadId}`
//! act across processes, as the real driver's do: a process whose first
//! `cuInit` sees [`CHECKPOINT_DIR_VAR`] naming a folder writes its control
//! block to `<folder>/<pid>` (a page whose layout `double/checkpoint.c`
//! gives: state, bytes on each device and on the host, the GPU each ordinal
//! runs on) and serves requests from a thread of its own; a caller, such as
//! the node daemon, with the same variable reaches it by pid. A lock holds
//! every later CUDA call of the target until the unlock; a checkpoint moves
//! all it holds on its devices to the host; a restore brings it back,
//! optionally onto other GPUs. `GPUSHARE_DOUBLE_CHECKPOINT_FAIL_RESTORES`
//! and `GPUSHARE_DOUBLE_CHECKPOINT_US_PER_GIB` (the target's) make restores
//! fail and moves take time. [`program`]`("ckptprobe")` is such a target.
//!
//! # Shared GPUs: the node file
//!
//! Each process has its fake GPUs to itself, unless its first `cuInit` sees
//! [`NODE_FILE_VAR`] naming a path: then the process maps that file (created
//! if missing) and every byte it charges to a GPU (allocations and all the
//! driver-held memory above) is also counted in the GPU's shared used bytes
//! there, and taken off when the charge goes. A charge fits only when the
//! shared used plus it is within `GPUSHARE_DOUBLE_TOTAL`, else it fails with
//! `CUDA_ERROR_OUT_OF_MEMORY` as on a full GPU of its own; processes that
//! died or were killed are reclaimed then (the file keeps a table of pids,
//! start times and bytes per GPU), and an exiting process takes its charges
//! off. A checkpoint takes the process's charges off the shared GPUs; a
//! restore puts them back on the GPUs it restores to, or fails with
//! `CUDA_ERROR_OUT_OF_MEMORY` (the process staying checkpointed) where they
//! do not fit. `nvmlDeviceGetMemoryInfo(_v2)`, where the variable is set,
//! report the whole node's use of the GPU; `cuMemGetInfo` and NVML's process
//! figures stay per process. The layout is at the top of `double/node.c`;
//! [`node_used`] reads a GPU's shared used bytes.
//!
//! The hidden export [`BUSY_SYMBOL`] gives the busy nanoseconds of a device
//! within a window, so a test can assert the share a limiter let through;
//! `cudaprobe`'s `spin`, `run`, `series`, `pace` and `maxstall` print it
//! (parse them with [`probe_field`]).
//!
//! # Targets
//!
//! The stubs are x86_64 assembly: on other targets `build.rs` builds nothing
//! and this crate is empty.

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod double {
    use std::ffi::OsString;
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// The first 12 bytes of every exported `cu*` entry point of the real
    /// driver and of the double: `push rbp; mov rbp,rsp; push r12; sub rsp,8`,
    /// then the opcode and ModRM of `cmp dword [rip+disp32], imm32`, whose
    /// `disp32` and `imm32` (8 bytes) follow.
    pub const CU_PROLOGUE: [u8; 12] = [
        0x55, 0x48, 0x89, 0xe5, 0x41, 0x54, 0x48, 0x83, 0xec, 0x08, 0x81, 0x3d,
    ];

    /// The `imm32` of the double's `cmp` (the real driver's differs; only its
    /// width matters).
    pub const CU_GUARD_IMM: u32 = 0x321c_ba00;

    /// Length of the double's whole `cu*` prologue up to its `jmp` (the cmp
    /// ends at byte 20).
    pub const CU_PROLOGUE_LEN: usize = 20;

    /// First bytes of `nvmlDeviceGetMemoryInfo` and `_v2`: `push rbp;
    /// mov rbp,rsp; push r14; mov r14,rsi; push r13; mov r13,rdi`.
    pub const NVML_MEMINFO_PROLOGUE: [u8; 14] = [
        0x55, 0x48, 0x89, 0xe5, 0x41, 0x56, 0x49, 0x89, 0xf6, 0x41, 0x55, 0x49, 0x89, 0xfd,
    ];

    /// `nvmlInit_v2` is `xor edi,edi; jmp rel32` (these 3 bytes, then the
    /// rel32 to `nvmlInitWithFlags`); `nvmlShutdown` starts right after.
    pub const NVML_INIT_V2_PREFIX: [u8; 3] = [0x31, 0xff, 0xe9];

    /// Bytes per fake GPU unless `GPUSHARE_DOUBLE_TOTAL` says otherwise (16 GiB).
    pub const DEFAULT_TOTAL: u64 = 16 << 30;

    /// Bytes each live context on a GPU charges, unless
    /// `GPUSHARE_DOUBLE_CONTEXT_BYTES` says otherwise (300 MiB).
    pub const DEFAULT_CONTEXT_BYTES: u64 = 300 << 20;

    /// Nanoseconds a kernel lasts when its launch gives no duration, unless
    /// `GPUSHARE_DOUBLE_KERNEL_NS` says otherwise (100 µs).
    pub const DEFAULT_KERNEL_NS: u64 = 100_000;

    /// Submissions a device holds (queued or running) before a launch
    /// blocks, unless `GPUSHARE_DOUBLE_QUEUE_DEPTH` says otherwise.
    pub const DEFAULT_QUEUE_DEPTH: u64 = 1024;

    /// The variable that names the folder of the checkpoint control blocks,
    /// read by a target at its first `cuInit` and by each caller.
    pub const CHECKPOINT_DIR_VAR: &str = "GPUSHARE_DOUBLE_CHECKPOINT_DIR";

    /// The variable that names the node file, whose fake GPUs the processes
    /// that see it at their first `cuInit` share (layout in `double/node.c`).
    pub const NODE_FILE_VAR: &str = "GPUSHARE_DOUBLE_NODE_FILE";

    /// The bytes every process of the node file at `path` charges to GPU
    /// `device` (its NVML index); `None` when the file is missing, not a node
    /// file of version 1 or has no such GPU.
    pub fn node_used(path: &Path, device: usize) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let file = std::fs::File::open(path).ok()?;
        let mut header = [0u8; 16];
        file.read_exact_at(&mut header, 0).ok()?;
        let devices = u32::from_le_bytes(header[12..16].try_into().ok()?);
        if &header[..8] != b"GSDNODE1"
            || u32::from_le_bytes(header[8..12].try_into().ok()?) != 1
            || device >= devices.min(16) as usize
        {
            return None;
        }
        let mut used = [0u8; 8];
        file.read_exact_at(&mut used, 64 + 8 * device as u64).ok()?;
        Some(u64::from_le_bytes(used))
    }

    /// The double's busy-time accessor, exported by its `libcuda.so.1`:
    /// `unsigned long long gpushare_double_busy_ns(int device, unsigned long
    /// long from_ns, unsigned long long to_ns)`, the nanoseconds of
    /// `[from_ns, to_ns)` (`CLOCK_MONOTONIC`) during which this process's
    /// kernels ran on `device`.
    pub const BUSY_SYMBOL: &str = "gpushare_double_busy_ns";

    /// The number after `key=` in a probe output line, e.g.
    /// `probe_field("spin kernel 1000 20 -> 0 wall_ns=20 busy_ns=20 share_pm=1000", "busy_ns")`
    /// is `Some(20)`.
    pub fn probe_field(line: &str, key: &str) -> Option<u64> {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(key)?.strip_prefix('='))?
            .parse()
            .ok()
    }

    /// Directory holding the double: `libcuda.so.1`, `libcuda.so`,
    /// `libnvidia-ml.so.1`, `libnvidia-ml.so`.
    pub fn double_dir() -> &'static Path {
        Path::new(env!("GPUSHARE_DOUBLE_DIR"))
    }

    /// A library to preload after the limiter: `pthread_create` fails for
    /// the limiter's own threads (a pod at its limit of threads), no other.
    pub fn fail_limiter_threads() -> PathBuf {
        double_dir().join("libfail_limiter_threads.so")
    }

    /// Path of a probe program built from `programs/`: `cudaprobe` (driver
    /// through `dlopen`, needs `LD_LIBRARY_PATH`), `cudaprobe_linked`
    /// (linked against the double, found through its rpath) or `ckptprobe`
    /// (linked too: a target for the checkpoint calls, commands on stdin).
    pub fn program(name: &str) -> PathBuf {
        Path::new(env!("GPUSHARE_PROGRAMS_DIR")).join(name)
    }

    /// A [`Command`] for [`program`]`(name)` with [`double_dir`] put first in
    /// `LD_LIBRARY_PATH`; the rest of the environment is inherited.
    pub fn command(name: &str) -> Command {
        let mut path = OsString::from(double_dir());
        if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|old| !old.is_empty()) {
            path.push(":");
            path.push(old);
        }
        let mut command = Command::new(program(name));
        command.env("LD_LIBRARY_PATH", path);
        command
    }

    /// Every `cu*` entry point the double's `libcuda.so.1` exports, each with
    /// [`CU_PROLOGUE`].
    pub fn cu_entry_points() -> impl Iterator<Item = &'static str> {
        include_str!("../double/cuda_entries.def")
            .lines()
            .filter_map(|line| line.strip_prefix("CU_ENTRY(")?.strip_suffix(')'))
    }

    /// Every `nvml*` entry point the double's `libnvidia-ml.so.1` exports.
    pub const NVML_ENTRY_POINTS: &[&str] = &[
        "nvmlInit_v2",
        "nvmlInitWithFlags",
        "nvmlShutdown",
        "nvmlErrorString",
        "nvmlDeviceGetCount_v2",
        "nvmlDeviceGetHandleByIndex_v2",
        "nvmlDeviceGetHandleByUUID",
        "nvmlDeviceGetHandleByPciBusId_v2",
        "nvmlDeviceGetUUID",
        "nvmlDeviceGetIndex",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetMemoryInfo_v2",
        "nvmlDeviceGetComputeRunningProcesses_v3",
    ];

    /// The UUID string of fake device `device`, as CUDA tools and NVML print
    /// it: bytes `11 22 … ff` then the index.
    pub fn uuid(device: u8) -> String {
        let bytes: Vec<u8> = (1..=15u8).map(|i| 0x11 * i).chain([device]).collect();
        let hex = |range: std::ops::Range<usize>| -> String {
            bytes[range].iter().map(|b| format!("{b:02x}")).collect()
        };
        format!(
            "GPU-{}-{}-{}-{}-{}",
            hex(0..4),
            hex(4..6),
            hex(6..8),
            hex(8..10),
            hex(10..16)
        )
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub use double::*;
