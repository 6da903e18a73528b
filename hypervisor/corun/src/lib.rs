//! Co-run mode: GPUs whose pods run their kernels at the same time on
//! different SMs, as clients of NVIDIA's MPS, instead of taking turns.
//!
//! A GPU is put in this mode by the node's operator (`--corun-gpu`). The
//! daemon then runs one MPS control daemon for it, with its own pipe and log
//! folders under [`CorunOptions::dir`] ([`pipe_dir`], [`log_dir`]), and every
//! pod given that GPU is provisioned as an MPS client of it. MPS fixes a
//! client's share of the SMs (its active thread percentage) when the client
//! starts, and no command changes it for a running client. So the share is
//! chosen for each client as it starts ([`active_thread_percentage`]): the
//! scheduler writes into each pod's limits what a client starting now
//! takes: the whole GPU while no pod of the other class is provisioned
//! there; while one is, the reserve for a latency pod and the rest of the
//! SMs for a batch pod. The limiter sets it before the driver starts. A
//! batch client that started alone keeps the whole GPU when a latency pod
//! comes, and the priority classes hold its launches while the latency pod
//! works. Memory quotas, reports and refusals stay the limiter's, inside
//! every client.
//!
//! MPS clients and their server share memory through `/dev/shm`; a
//! container has a `/dev/shm` of its own. Where pods are containers
//! ([`CorunOptions::private_shm`]), each GPU's daemon runs in a mount
//! namespace of its own whose `/dev/shm` is the GPU's [`shm_dir`], and that
//! folder is what its pods' containers get at `/dev/shm` ([`shm`]): never
//! the daemon's own `/dev/shm`, which holds every pod's region and limits.
//!
//! The daemon's side: [`flags`] (the `serve` flags that make the options),
//! [`supervisor`] (one supervised control daemon per co-run GPU, through
//! [`control`], the control program's client mode, and [`mps_log`], what
//! the daemon and its servers log), [`board`] (each GPU's state, read by
//! the status, the metrics and `/readyz`).

pub mod board;
pub mod control;
pub mod flags;
pub mod mps_log;
pub mod shm;
pub mod supervisor;

use std::path::{Path, PathBuf};
use std::time::Duration;

use gpushare_utils::pod::PodClass;

pub use board::{CorunGpuStatus, MpsBoard, MpsState};
pub use flags::CorunArgs;
pub use supervisor::{MpsSupervisor, Timing};

/// Why co-run mode could not start, or a command to MPS failed.
#[derive(Debug, thiserror::Error)]
pub enum CorunError {
    /// A `--corun-gpu` names neither a UUID nor an index of a GPU the
    /// observer lists.
    #[error("--corun-gpu {0}: no such GPU (a UUID or an index the observer lists)")]
    UnknownGpu(String),
    /// A GPU's pipe folder is too long a path for the sockets MPS makes in
    /// it: its control daemon would exit at start.
    #[error(
        "the MPS pipe folder {} is {len} bytes long; MPS names Unix sockets in it, so it may be at most {MAX_PIPE_DIR_LEN}: choose a shorter --corun-dir",
        path.display()
    )]
    PipeFolderTooLong {
        /// The GPU's pipe folder ([`pipe_dir`]).
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// A GPU's pipe, log or shared-memory folder could not be made, or
    /// something other than a folder is at its path.
    #[error("cannot make the MPS folder {}: {source}", path.display())]
    Folder {
        /// The folder that could not be made.
        path: PathBuf,
        /// The file system's error.
        #[source]
        source: std::io::Error,
    },
    /// The file naming a GPU's UUID for its clients could not be written.
    #[error("cannot write {}: {source}", path.display())]
    ServedGpu {
        /// The file.
        path: PathBuf,
        /// The file system's error.
        #[source]
        source: std::io::Error,
    },
    /// The MPS control program could not be started (not installed at
    /// `--mps-control`, not executable).
    #[error("cannot run {}: {source}", program.display())]
    Spawn {
        /// The control program, as configured.
        program: PathBuf,
        /// The error from starting it.
        #[source]
        source: std::io::Error,
    },
    /// The control daemon could not be started in a mount namespace of its
    /// own with the GPU's shared-memory folder at `/dev/shm`: usually the
    /// hypervisor lacks `CAP_SYS_ADMIN`.
    #[error(
        "cannot run {} in a mount namespace with {} as its /dev/shm (needs CAP_SYS_ADMIN): {source}",
        program.display(),
        folder.display()
    )]
    SpawnWithShm {
        /// The control program, as configured.
        program: PathBuf,
        /// The GPU's shared-memory folder (its [`shm_dir`]).
        folder: PathBuf,
        /// The error from the namespace set-up or from starting the program.
        #[source]
        source: std::io::Error,
    },
    /// The control daemon's log file could not be opened for its output.
    #[error("cannot open the MPS log {}: {source}", path.display())]
    Log {
        /// The log file, [`mps_log::LOG_FILE`] in the GPU's [`log_dir`].
        path: PathBuf,
        /// The file system's error.
        #[source]
        source: std::io::Error,
    },
    /// The GPU's shared-memory folder could not be set up as the control
    /// daemon's `/dev/shm` before it starts (its path is not usable, such as
    /// one with a NUL byte).
    #[error("the MPS shared-memory folder {}: {source}", folder.display())]
    Shm {
        /// The GPU's shared-memory folder (its [`shm_dir`]).
        folder: PathBuf,
        /// Why the folder could not be used.
        #[source]
        source: std::io::Error,
    },
    /// The control program ran but failed: it could not be written to, or it
    /// exited non-zero (no daemon answering on the pipe folder, for one).
    #[error("MPS command {command:?} failed: {detail}")]
    Command {
        /// The command sent on its stdin (`get_server_list`, `quit`).
        command: String,
        /// The exit status and the program's stderr, or the write error.
        detail: String,
    },
    /// The control program did not exit within the timeout; it was killed.
    #[error("MPS command {command:?} took longer than {after:?}")]
    Timeout {
        /// The command sent on its stdin.
        command: String,
        /// The timeout it ran past.
        after: Duration,
    },
    /// A per-GPU supervision thread could not be spawned; the threads
    /// already started are stopped.
    #[error("cannot start an MPS supervision thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// Percent of a co-run GPU's SMs kept for latency pods by default.
pub const DEFAULT_LATENCY_RESERVE: u8 = 20;

/// Where the MPS control program usually is.
pub const DEFAULT_MPS_CONTROL: &str = "/usr/bin/nvidia-cuda-mps-control";

/// The co-run GPUs of this node and how they are run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CorunOptions {
    /// UUIDs (`GPU-…`) of the GPUs in co-run mode.
    pub gpus: Vec<String>,
    /// Folder of the MPS folders, as the daemon sees it.
    pub dir: PathBuf,
    /// `dir` as the host (the container runtime) sees it.
    pub host_dir: PathBuf,
    /// Percent of the SMs batch clients are kept from, for latency pods.
    pub latency_reserve: u8,
    /// The `nvidia-cuda-mps-control` program.
    pub control: PathBuf,
    /// Whether each daemon gets its GPU's [`shm_dir`] as `/dev/shm` (and its
    /// clients the same folder): pods are containers, which do not see the
    /// host's `/dev/shm`. Off, daemon and clients share the host's.
    pub private_shm: bool,
}

impl CorunOptions {
    /// Whether GPU `uuid` is in co-run mode.
    pub fn covers(&self, uuid: &str) -> bool {
        self.gpus.iter().any(|g| g.eq_ignore_ascii_case(uuid))
    }
}

/// The pipe folder of GPU `uuid`'s MPS control daemon under `dir`
/// (`CUDA_MPS_PIPE_DIRECTORY` of the daemon and of its clients).
pub fn pipe_dir(dir: &Path, uuid: &str) -> PathBuf {
    dir.join(uuid).join("pipe")
}

/// The longest pipe folder MPS starts in, in bytes. A Unix socket's path
/// holds at most 107 bytes, and the control daemon makes its sockets
/// (`control`, `control_privileged`) in its pipe folder, keeping room for
/// longer names than those: measured with driver 580, it starts in a pipe
/// folder of 87 bytes and at 88 exits with status 1 before it answers.
pub const MAX_PIPE_DIR_LEN: usize = 87;

/// The log folder of GPU `uuid`'s MPS control daemon under `dir`
/// (`CUDA_MPS_LOG_DIRECTORY`).
pub fn log_dir(dir: &Path, uuid: &str) -> PathBuf {
    dir.join(uuid).join("log")
}

/// The shared-memory folder of GPU `uuid`'s MPS daemon and clients under
/// `dir`, where [`CorunOptions::private_shm`] is on.
pub fn shm_dir(dir: &Path, uuid: &str) -> PathBuf {
    dir.join(uuid).join("shm")
}

/// The active thread percentage (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) a
/// client of class `class` takes when it starts, `reserve` percent of the
/// SMs being kept for latency pods. Beside pods of the other class
/// (`beside_other_class`), each class keeps to its part: a batch client to
/// the rest, a latency client to the reserve (its kernels would otherwise
/// also land on SMs the batch clients hold; with no reserve, all of it).
/// Alone, either takes the whole GPU. A batch pod's fixed `sm_share`
/// narrows its part; a latency pod's is its part, whatever the reserve.
///
/// MPS fixes the percentage for the client's life, so a client that started
/// alone keeps the whole GPU when a pod of the other class comes; a batch
/// one is then held back by the priority classes (the limiter's, in time).
pub fn active_thread_percentage(
    class: PodClass,
    reserve: u8,
    sm_share: Option<u8>,
    beside_other_class: bool,
) -> u8 {
    let part = match class {
        _ if !beside_other_class => 100,
        PodClass::Batch => 100 - reserve.min(99),
        PodClass::Latency if reserve == 0 => 100,
        PodClass::Latency => reserve.min(100),
    };
    // A fixed share stays within a batch pod's part; it is a latency pod's.
    let ceiling = match class {
        PodClass::Batch => part,
        PodClass::Latency => 100,
    };
    sm_share.map_or(part, |share| share.clamp(1, ceiling))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn beside_each_other_each_class_keeps_to_its_part() {
        let atp = active_thread_percentage;
        // Beside batch pods, a latency client keeps to the reserve; alone,
        // or with no reserve, it takes the whole GPU.
        assert_eq!(atp(PodClass::Latency, 20, None, true), 20);
        assert_eq!(atp(PodClass::Latency, 20, None, false), 100);
        assert_eq!(atp(PodClass::Latency, 0, None, true), 100);
        assert_eq!(atp(PodClass::Batch, 20, None, true), 80);
        // Alone, a batch client takes the whole GPU.
        assert_eq!(atp(PodClass::Batch, 20, None, false), 100);
        assert_eq!(atp(PodClass::Batch, 0, None, true), 100);
        // A batch client keeps at least 1%.
        assert_eq!(atp(PodClass::Batch, 100, None, true), 1);
        // A fixed share narrows, never widens, and is at least 1%.
        assert_eq!(atp(PodClass::Batch, 20, Some(50), true), 50);
        assert_eq!(atp(PodClass::Batch, 20, Some(90), true), 80);
        assert_eq!(atp(PodClass::Batch, 20, Some(90), false), 90);
        // A latency pod's fixed share is its part, whatever the reserve.
        assert_eq!(atp(PodClass::Latency, 20, Some(30), true), 30);
        assert_eq!(atp(PodClass::Latency, 20, Some(10), false), 10);
        assert_eq!(atp(PodClass::Batch, 20, Some(0), false), 1);
    }

    #[test]
    fn folders_are_per_gpu() {
        let dir = Path::new("/run/gpushare/mps");
        assert_eq!(
            pipe_dir(dir, "GPU-1"),
            PathBuf::from("/run/gpushare/mps/GPU-1/pipe")
        );
        assert_eq!(
            log_dir(dir, "GPU-1"),
            PathBuf::from("/run/gpushare/mps/GPU-1/log")
        );
        assert_eq!(
            shm_dir(dir, "GPU-1"),
            PathBuf::from("/run/gpushare/mps/GPU-1/shm")
        );
        let options = CorunOptions {
            gpus: vec!["GPU-AB".into()],
            dir: dir.into(),
            host_dir: dir.into(),
            latency_reserve: DEFAULT_LATENCY_RESERVE,
            control: DEFAULT_MPS_CONTROL.into(),
            private_shm: false,
        };
        assert!(options.covers("gpu-ab") && !options.covers("GPU-CD"));
    }
}
