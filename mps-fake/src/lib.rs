//! A test double of NVIDIA's `nvidia-cuda-mps-control`, never shipped: the
//! co-run supervisor's tests run it in place of the real program, on
//! machines without a GPU. It behaves as the real one for what the
//! hypervisor uses:
//!
//! 1. **Daemon** (`-f`, in the foreground; `-d` starts one in the
//!    background and returns once it answers). It binds the Unix socket
//!    [`SOCKET`] in `$CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`),
//!    writes its pid to [`PID_FILE`] there and appends to [`LOG_FILE`] in
//!    `$CUDA_MPS_LOG_DIRECTORY` (default `/var/log/nvidia-mps`): a line with
//!    the environment it was started with ([`log::STARTED`]), then one per
//!    command received ([`log::COMMAND`]), so tests can check both.
//! 2. **Commands** ([`commands`]): one text line each, answered with text.
//!    The state is kept in memory: the default active thread percentage and
//!    a list of fake servers, empty until `start_server -uid <UID>` (the
//!    real command a client's first connection stands for) adds one. Fake
//!    servers are numbers, not processes.
//! 3. **Stop**: `quit`, SIGTERM or SIGINT remove the socket and the pid file
//!    and exit 0.
//! 4. **Client** (no argument): every line of stdin goes to the daemon as
//!    one connection; the answers are printed. Without a daemon it prints
//!    [`client::NO_DAEMON`] on stderr and exits 1, as the real one does.
//!
//! One test hook the real program does not have: [`HANG_AFTER`]
//! (`MPS_FAKE_HANG_AFTER=<n>`), read when the daemon starts, makes it stop
//! answering after `n` answered commands while staying alive: it still
//! accepts connections, holds them open and never answers, as a hung
//! daemon does; SIGTERM and SIGINT still stop it. For the supervisor's
//! liveness check.

pub mod client;
pub mod commands;
pub mod daemon;
pub mod log;

use std::path::PathBuf;

/// The daemon's socket in the pipe folder.
pub const SOCKET: &str = "control";
/// The daemon's pid file in the pipe folder.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The daemon's log in the log folder.
pub const LOG_FILE: &str = "control.log";

/// Test hook (not in the real program): the environment variable naming
/// how many commands the daemon answers before it hangs.
pub const HANG_AFTER: &str = "MPS_FAKE_HANG_AFTER";

/// The daemon's [`HANG_AFTER`] count: `None` when unset or empty (it never
/// hangs), an error when it is not a number, so a test's typo is loud.
pub fn hang_after() -> Result<Option<u64>, FakeError> {
    let Some(value) = std::env::var_os(HANG_AFTER).filter(|v| !v.is_empty()) else {
        return Ok(None);
    };
    value
        .to_str()
        .and_then(|text| text.trim().parse().ok())
        .map(Some)
        .ok_or_else(|| FakeError::Hook {
            name: HANG_AFTER,
            value: value.to_string_lossy().into_owned(),
        })
}

/// The pipe folder: `$CUDA_MPS_PIPE_DIRECTORY`, else the real default.
pub fn pipe_dir() -> PathBuf {
    env_dir("CUDA_MPS_PIPE_DIRECTORY", "/tmp/nvidia-mps")
}

/// The log folder: `$CUDA_MPS_LOG_DIRECTORY`, else the real default.
pub fn log_dir() -> PathBuf {
    env_dir("CUDA_MPS_LOG_DIRECTORY", "/var/log/nvidia-mps")
}

fn env_dir(name: &str, default: &str) -> PathBuf {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from(default), PathBuf::from)
}

/// Why the fake failed.
#[derive(Debug, thiserror::Error)]
pub enum FakeError {
    /// Another daemon answers on the socket already.
    #[error("An instance of this daemon is already running ({})", .0.display())]
    AlreadyRunning(PathBuf),
    /// No daemon answers on the socket (client mode).
    #[error("{}", client::NO_DAEMON)]
    NoDaemon,
    /// A test hook's environment variable is not what it takes.
    #[error("{name}={value:?} is not a number")]
    Hook { name: &'static str, value: String },
    /// A file or socket operation failed.
    #[error("cannot {what} {}: {source}", .path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl FakeError {
    /// An I/O error of `what` on `path`.
    pub fn io(
        what: &'static str,
        path: impl AsRef<std::path::Path>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.as_ref().to_owned();
        move |source| Self::Io { what, path, source }
    }
}
