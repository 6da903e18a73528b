//! A test double of NVIDIA's `nvidia-cuda-mps-control`, never shipped: the
//! co-run supervisor's tests run it in place of the real program, on
//! machines without a GPU. It behaves as the real one for what the
//! hypervisor uses:
//!
//! 1. **Daemon** (`-f`, in the foreground; `-d` starts one in the
//!    background and returns once it answers). It binds the Unix socket
//!    [`SOCKET`] in `$CUDA_MPS_PIPE_DIRECTORY` (default `/tmp/nvidia-mps`),
//!    writes its pid to [`PID_FILE`] there, the GPUs its servers serve to
//!    [`SERVED_DEVICES_FILE`] (for the driver double's clients), and logs, as the real one in the
//!    foreground, to stdout ([`log`]; `-d` appends it to [`LOG_FILE`] in
//!    `$CUDA_MPS_LOG_DIRECTORY`, default `/var/log/nvidia-mps`): a line with
//!    the environment it was started with ([`log::STARTED`]), then one per
//!    command received ([`log::COMMAND`]), so tests can check both.
//! 2. **Commands** ([`commands`]): one text line each, answered with text.
//!    The state is kept in memory: the default active thread percentage and
//!    a list of fake servers, empty until `start_server -uid <UID>` (the
//!    real command a client's first connection stands for) adds one. Fake
//!    servers are numbers, not processes.
//! 3. **Stop**: `quit`, SIGTERM or SIGINT remove the socket and the pid file
//!    (and [`SERVED_DEVICES_FILE`]) and exit 0.
//! 4. **Client** (no argument): every line of stdin goes to the daemon as
//!    one connection; the answers are printed. Without a daemon it prints
//!    [`client::NO_DAEMON`] on stderr and exits 1, as the real one does.
//!
//! Two test hooks the real program does not have, read when the daemon
//! starts ([`Hooks`]): [`HANG_AFTER`] (`MPS_FAKE_HANG_AFTER=<n>`) makes it
//! stop answering after `n` answered commands while staying alive: it still
//! accepts connections, holds them open and never answers, as a hung
//! daemon does; SIGTERM and SIGINT still stop it. For the supervisor's
//! liveness check. [`SERVER_FAILS`] (`MPS_FAKE_SERVER_FAILS=<reason>`)
//! makes every server it starts fail to, logging what the real daemon logs
//! then ([`log::Log::server_failed`]). For the supervisor's report of
//! servers that refuse their clients.

pub mod client;
pub mod commands;
pub mod daemon;
pub mod log;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// The daemon's socket in the pipe folder.
pub const SOCKET: &str = "control";
/// The daemon's pid file in the pipe folder.
pub const PID_FILE: &str = "nvidia-cuda-mps-control.pid";
/// The daemon's log in the log folder.
pub const LOG_FILE: &str = "control.log";

/// Not in the real program: the file in the pipe folder naming the GPUs
/// the daemon's servers serve (its `CUDA_VISIBLE_DEVICES` as started), for
/// the driver double, whose MPS clients enumerate those GPUs alone as the
/// real driver's do. The double reads it under this name.
pub const SERVED_DEVICES_FILE: &str = "fake-served-devices";

/// Test hook (not in the real program): the environment variable naming
/// how many commands the daemon answers before it hangs.
pub const HANG_AFTER: &str = "MPS_FAKE_HANG_AFTER";

/// Test hook (not in the real program): the environment variable naming
/// why every server the daemon starts fails to.
pub const SERVER_FAILS: &str = "MPS_FAKE_SERVER_FAILS";

/// The test hooks a daemon starts with.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Hooks {
    /// [`HANG_AFTER`]: `None` when unset or empty (it never hangs).
    pub hang_after: Option<u64>,
    /// [`SERVER_FAILS`]: `None` when unset or empty (servers start).
    pub server_fails: Option<String>,
}

impl Hooks {
    /// The hooks of this process's environment; an error when
    /// [`HANG_AFTER`] is not a number, so a test's typo is loud.
    pub fn from_env() -> Result<Self, FakeError> {
        let set = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        let hang_after = match set(HANG_AFTER) {
            None => None,
            Some(value) => Some(
                value
                    .to_str()
                    .and_then(|text| text.trim().parse().ok())
                    .ok_or_else(|| FakeError::Hook {
                        name: HANG_AFTER,
                        value: value.to_string_lossy().into_owned(),
                    })?,
            ),
        };
        let server_fails = set(SERVER_FAILS).map(|v| v.to_string_lossy().into_owned());
        Ok(Self {
            hang_after,
            server_fails,
        })
    }
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
    Hook {
        /// The variable.
        name: &'static str,
        /// What it held.
        value: String,
    },
    /// A file or socket operation failed.
    #[error("cannot {what} {}: {source}", .path.display())]
    Io {
        /// What was being done.
        what: &'static str,
        /// To which file or socket.
        path: PathBuf,
        /// Why it failed.
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

/// The fake control program, built once per test process, for tests of
/// other crates.
///
/// Cargo builds the libraries of dev-dependencies, never their binaries,
/// and `CARGO_BIN_EXE_*` exists only in the tests of the binary's own
/// crate. So this runs `cargo build -p mps-fake --bin
/// nvidia-cuda-mps-control` (a no-op when fresh, so a changed fake is never
/// missed) into the target folder and profile of this test binary, which
/// lives in `<target>/<profile>/deps/`: the fake is then
/// `<target>/<profile>/nvidia-cuda-mps-control`. Cargo releases its build
/// lock before it runs tests, so the nested build does not wait for the
/// outer one. Run by hand without `$CARGO`, an existing build is used.
pub fn program() -> &'static Path {
    static FAKE: OnceLock<PathBuf> = OnceLock::new();
    FAKE.get_or_init(|| {
        let exe = std::env::current_exe().expect("the test binary's path");
        let profile_dir = exe
            .parent()
            .and_then(Path::parent)
            .expect("the test binary lives in <target>/<profile>/deps");
        let fake = profile_dir.join("nvidia-cuda-mps-control");
        let target = profile_dir.parent().expect("<target>");
        let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
            Some("debug") | None => "dev",
            Some(other) => other,
        };
        let built = std::env::var_os("CARGO").map(|cargo| {
            Command::new(cargo)
                .args(["build", "--quiet", "-p", "mps-fake", "--bin"])
                .arg("nvidia-cuda-mps-control")
                .args(["--profile", profile])
                .env("CARGO_TARGET_DIR", target)
                .status()
        });
        match built {
            Some(Ok(status)) if status.success() => {}
            other if fake.exists() => {
                eprintln!(
                    "building the fake failed ({other:?}); using {}",
                    fake.display()
                );
            }
            other => panic!(
                "cannot build the fake nvidia-cuda-mps-control ({other:?}): run \
                 `cargo build -p mps-fake` first"
            ),
        }
        assert!(fake.exists(), "{} missing after the build", fake.display());
        fake
    })
}
