//! One supervised MPS control daemon per co-run GPU.
//!
//! For each GPU a thread of its own (the daemon is a child process that is
//! waited for, and the control program's client mode blocks; neither
//! belongs on the async runtime's threads):
//!
//! 1. makes the GPU's pipe and log folders ([`control::prepare_folders`]),
//!    and its shared-memory folder where clients are containers, and names
//!    the GPU beside them for its clients ([`control::name_served_gpu`]);
//! 2. quits a control daemon an earlier run of ours left there (its pid
//!    file names a live process running the control program);
//! 3. starts `<control> -f` with `CUDA_VISIBLE_DEVICES=<uuid>` (it serves
//!    that GPU alone), `CUDA_MPS_PIPE_DIRECTORY` and
//!    `CUDA_MPS_LOG_DIRECTORY`, in a mount namespace whose `/dev/shm` is
//!    the shared-memory folder where there is one ([`super::shm`]), its
//!    stdout and stderr (its log and its servers', in the foreground)
//!    appended to `control.log` in the log folder ([`super::mps_log`]);
//! 4. polls `get_server_list` through the client mode: up once it answers
//!    (a client whose daemon does not answer runs without MPS, so "up" is
//!    what `/readyz` waits for);
//! 5. while it is up, reads what the log gains every poll: a server that
//!    exited failing (its clients were refused CUDA) is counted on the
//!    board and logged with its last line; and sends `get_server_list`
//!    every 10 s: after 3 failures in a row it is hung (alive, not
//!    answering: new clients would run without MPS), so it is marked down
//!    ("does not answer") and killed, SIGTERM then SIGKILL;
//! 6. when the daemon exits or was killed, starts it again after a backoff
//!    of 1 s, doubling to 30 s, back to 1 s once a daemon stayed up a
//!    minute;
//! 7. on shutdown sends `quit`, waits up to 5 s, then SIGTERM, then SIGKILL,
//!    and removes the socket and pid file a killed daemon leaves.
//!
//! Every step is written to the [`MpsBoard`] the status, the metrics and
//! `/readyz` read.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::board::{LastServerFailure, MpsBoard, MpsState};
use super::control::{self, Control};
use super::mps_log::{self, DaemonLog};
use super::{CorunError, CorunOptions, log_dir, pipe_dir, shm, shm_dir};
use hypervisor_observer::clock::unix_secs;

/// How long each step may take; [`Timing::default`] is what the daemon
/// uses, tests shorten some.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timing {
    /// The wait before the first restart.
    pub first_backoff: Duration,
    /// The longest wait between restarts.
    pub max_backoff: Duration,
    /// A daemon up this long resets the backoff.
    pub stable_after: Duration,
    /// A started daemon not answering by then is killed and restarted.
    pub ready_within: Duration,
    /// How long one command through the client mode may take.
    pub command_timeout: Duration,
    /// How long a daemon has to exit after `quit`.
    pub quit_grace: Duration,
    /// How long after SIGTERM before SIGKILL.
    pub term_grace: Duration,
    /// How often readiness and the daemon's exit are looked at.
    pub poll: Duration,
    /// How often an up daemon is asked `get_server_list`.
    pub liveness_interval: Duration,
    /// Failed liveness checks in a row after which the daemon is killed.
    pub liveness_failures: u32,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            first_backoff: Duration::from_secs(1),
            max_backoff: Duration::from_secs(30),
            stable_after: Duration::from_secs(60),
            ready_within: Duration::from_secs(30),
            command_timeout: Duration::from_secs(5),
            quit_grace: Duration::from_secs(5),
            term_grace: Duration::from_secs(2),
            poll: Duration::from_millis(50),
            liveness_interval: Duration::from_secs(10),
            liveness_failures: 3,
        }
    }
}

/// The running supervision; stops its daemons when shut down or dropped.
pub struct MpsSupervisor {
    board: Arc<MpsBoard>,
    stop: Arc<Stop>,
    threads: Vec<JoinHandle<()>>,
}

impl MpsSupervisor {
    /// Makes every co-run GPU's folders and starts supervising its daemon.
    pub fn start(options: &CorunOptions) -> Result<Self, CorunError> {
        Self::with_timing(options, Timing::default())
    }

    /// [`MpsSupervisor::start`] with other timings.
    pub fn with_timing(options: &CorunOptions, timing: Timing) -> Result<Self, CorunError> {
        let shm = |uuid: &str| options.private_shm.then(|| shm_dir(&options.dir, uuid));
        for uuid in &options.gpus {
            let (pipe, log) = (pipe_dir(&options.dir, uuid), log_dir(&options.dir, uuid));
            let shm = shm(uuid);
            control::prepare_folders(&pipe, &log, shm.as_deref())?;
            control::name_served_gpu(&options.dir, uuid)?;
            if let Some(shm) = &shm
                && !shm::is_tmpfs(shm).unwrap_or(false)
            {
                tracing::warn!(
                    folder = %shm.display(),
                    "the MPS shared-memory folder is not on a tmpfs: clients and servers exchange memory through files on disk (put --corun-dir on a tmpfs, as /run is)"
                );
            }
        }
        let board = Arc::new(MpsBoard::new(&options.gpus));
        let stop = Arc::new(Stop::default());
        let mut threads = Vec::new();
        for uuid in &options.gpus {
            let gpu = Supervised {
                uuid: uuid.clone(),
                control: Control {
                    program: options.control.clone(),
                    pipe: pipe_dir(&options.dir, uuid),
                },
                log: log_dir(&options.dir, uuid),
                shm: shm(uuid),
                board: Arc::clone(&board),
                stop: Arc::clone(&stop),
                timing,
            };
            let spawned = std::thread::Builder::new()
                .name(format!("mps-{}", short(uuid)))
                .spawn(move || gpu.run());
            match spawned {
                Ok(thread) => threads.push(thread),
                Err(source) => {
                    // Stops the threads already started.
                    drop(Self {
                        board,
                        stop,
                        threads,
                    });
                    return Err(CorunError::Thread(source));
                }
            }
        }
        Ok(Self {
            board,
            stop,
            threads,
        })
    }

    /// The GPUs' states, for the hypervisor's status and `/readyz`.
    pub fn board(&self) -> Arc<MpsBoard> {
        Arc::clone(&self.board)
    }

    /// Quits every daemon (see the module's step 7) and waits for it.
    pub fn shutdown(mut self) {
        self.stop_all();
    }

    fn stop_all(&mut self) {
        self.stop.set();
        for thread in self.threads.drain(..) {
            if thread.join().is_err() {
                tracing::error!("an MPS supervision thread panicked");
            }
        }
    }
}

impl Drop for MpsSupervisor {
    fn drop(&mut self) {
        self.stop_all();
    }
}

/// The end of one daemon's life.
enum Ended {
    /// The hypervisor stops: the daemon was quit.
    Stopped,
    /// It exited, never answered or stopped answering; the reason.
    Failed(String),
}

/// One GPU's daemon and what its thread needs.
struct Supervised {
    uuid: String,
    control: Control,
    log: PathBuf,
    /// The daemon's `/dev/shm`, where it has one of its own.
    shm: Option<PathBuf>,
    board: Arc<MpsBoard>,
    stop: Arc<Stop>,
    timing: Timing,
}

impl Supervised {
    fn run(self) {
        self.quit_leftover();
        let mut log = DaemonLog::follow(&self.log);
        let mut backoff = self.timing.first_backoff;
        let mut first = true;
        while !self.stop.is_set() {
            self.board.update(&self.uuid, |g| {
                g.state = MpsState::Starting;
                g.restarts += u64::from(!first);
            });
            first = false;
            let started = Instant::now();
            let reason = match self.run_once(&mut log) {
                Ended::Stopped => break,
                Ended::Failed(reason) => reason,
            };
            if started.elapsed() >= self.timing.stable_after {
                backoff = self.timing.first_backoff;
            }
            tracing::warn!(gpu = %self.uuid, %reason, retry_in = ?backoff, "MPS control daemon down");
            self.board.update(&self.uuid, |g| {
                g.state = MpsState::Down {
                    reason,
                    since: unix_secs(),
                };
                g.pid = None;
            });
            if self.stop.wait(backoff) {
                break;
            }
            backoff = (backoff * 2).min(self.timing.max_backoff);
        }
        self.board.update(&self.uuid, |g| {
            g.state = MpsState::Stopped;
            g.pid = None;
        });
    }

    /// Starts the daemon, waits until it answers, then watches it (and its
    /// `log`) until it exits, stops answering or the hypervisor stops.
    fn run_once(&self, log: &mut DaemonLog) -> Ended {
        let mut child = match self.spawn() {
            Ok(child) => child,
            Err(error) => return Ended::Failed(error.to_string()),
        };
        let pid = child.id();
        self.board.update(&self.uuid, |g| g.pid = Some(pid));
        let deadline = Instant::now() + self.timing.ready_within;
        loop {
            if self.stop.is_set() {
                self.quit(&mut child);
                return Ended::Stopped;
            }
            if let Some(ended) = exited(&mut child) {
                return Ended::Failed(format!("{ended} before answering"));
            }
            match self
                .control
                .send("get_server_list", self.timing.command_timeout)
            {
                Ok(_) => break,
                Err(error) if Instant::now() >= deadline => {
                    self.quit(&mut child);
                    return Ended::Failed(format!(
                        "no answer within {:?}: {error}",
                        self.timing.ready_within
                    ));
                }
                Err(_) => {}
            }
            if self.stop.wait(self.timing.poll) {
                self.quit(&mut child);
                return Ended::Stopped;
            }
        }
        tracing::info!(gpu = %self.uuid, pid, "MPS control daemon up");
        self.board.update(&self.uuid, |g| {
            g.state = MpsState::Up { since: unix_secs() };
        });
        self.watch(&mut child, log)
    }

    /// Step 5: while the daemon is up, looks at its exit and its log every
    /// poll and asks it `get_server_list` every liveness interval, until it
    /// exits, fails the check too often (then it is killed) or the
    /// hypervisor stops.
    fn watch(&self, child: &mut Child, log: &mut DaemonLog) -> Ended {
        let mut next_check = Instant::now() + self.timing.liveness_interval;
        let mut failures: u32 = 0;
        let mut unreadable = false;
        loop {
            // The condvar wakes this at once on shutdown; only a check in
            // flight (at most the command timeout) delays it.
            if self.stop.wait(self.timing.poll) {
                self.quit(child);
                return Ended::Stopped;
            }
            match log.failures() {
                Ok(servers) => {
                    unreadable = false;
                    servers.into_iter().for_each(|s| self.server_failed(s));
                }
                Err(error) if !unreadable => {
                    unreadable = true;
                    tracing::warn!(gpu = %self.uuid, log = %log.path().display(), %error, "cannot read the MPS log: failing servers go unreported");
                }
                Err(_) => {}
            }
            if let Some(ended) = exited(child) {
                return Ended::Failed(ended);
            }
            if Instant::now() < next_check {
                continue;
            }
            match self
                .control
                .send("get_server_list", self.timing.command_timeout)
            {
                Ok(_) => failures = 0,
                Err(error) => {
                    failures += 1;
                    tracing::warn!(gpu = %self.uuid, failures, %error, "MPS control daemon did not answer");
                    if failures >= self.timing.liveness_failures {
                        // Exited while it was asked: that is the reason.
                        if let Some(ended) = exited(child) {
                            return Ended::Failed(ended);
                        }
                        self.kill(child);
                        return Ended::Failed(format!(
                            "does not answer ({failures} checks in a row): {error}"
                        ));
                    }
                }
            }
            next_check = Instant::now() + self.timing.liveness_interval;
        }
    }

    /// A server exited failing: its clients were refused CUDA (one that
    /// could not start) or lost it.
    fn server_failed(&self, failure: mps_log::ServerFailure) {
        tracing::warn!(gpu = %self.uuid, "{failure}; its clients were refused CUDA or lost it");
        self.board.update(&self.uuid, |g| {
            g.server_failures += 1;
            g.last_server_failure = Some(LastServerFailure {
                failure,
                at: unix_secs(),
            });
        });
    }

    fn spawn(&self) -> Result<Child, CorunError> {
        let path = self.log.join(mps_log::LOG_FILE);
        let log_error = |source| CorunError::Log {
            path: path.clone(),
            source,
        };
        let stdout = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(log_error)?;
        let stderr = stdout.try_clone().map_err(log_error)?;
        let mut command = Command::new(&self.control.program);
        if let Some(folder) = &self.shm {
            shm::run_with_shm(&mut command, folder).map_err(|source| CorunError::Shm {
                folder: folder.clone(),
                source,
            })?;
        }
        command
            .arg("-f")
            .env("CUDA_VISIBLE_DEVICES", &self.uuid)
            .env("CUDA_MPS_PIPE_DIRECTORY", &self.control.pipe)
            .env("CUDA_MPS_LOG_DIRECTORY", &self.log)
            // The daemon's own value would become its servers' default;
            // each client sets its share instead.
            .env_remove("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE")
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .map_err(|source| match &self.shm {
                // The namespace's failure or the exec's: both named.
                Some(folder) => CorunError::SpawnWithShm {
                    program: self.control.program.clone(),
                    folder: folder.clone(),
                    source,
                },
                None => CorunError::Spawn {
                    program: self.control.program.clone(),
                    source,
                },
            })
    }

    /// Step 7 for our child: `quit`, then SIGTERM, then SIGKILL.
    fn quit(&self, child: &mut Child) {
        let asked = Instant::now();
        if let Err(error) = self.control.send("quit", self.timing.quit_grace) {
            tracing::debug!(gpu = %self.uuid, %error, "quit not answered");
        }
        let left = self.timing.quit_grace.saturating_sub(asked.elapsed());
        if control::wait_exit(child, left).is_none() {
            tracing::warn!(gpu = %self.uuid, "MPS control daemon ignored quit: SIGTERM");
            self.kill(child);
        } else {
            control::remove_daemon_files(&self.control.pipe);
        }
    }

    /// SIGTERM, SIGKILL after the term grace, then the files a killed
    /// daemon leaves removed. For a daemon that cannot be asked to quit.
    fn kill(&self, child: &mut Child) {
        if let Ok(pid) = i32::try_from(child.id()) {
            control::signal(pid, libc::SIGTERM);
        }
        if control::wait_exit(child, self.timing.term_grace).is_none() {
            tracing::warn!(gpu = %self.uuid, "MPS control daemon ignored SIGTERM: SIGKILL");
            let _ = child.kill();
            let _ = child.wait();
        }
        control::remove_daemon_files(&self.control.pipe);
    }

    /// Step 2: a daemon of an earlier run (not our child) in our pipe folder.
    fn quit_leftover(&self) {
        let Some(pid) = control::leftover_daemon(&self.control.pipe, &self.control.program) else {
            control::remove_daemon_files(&self.control.pipe);
            return;
        };
        tracing::warn!(gpu = %self.uuid, pid, "quitting the MPS control daemon of an earlier run");
        if let Err(error) = self.control.send("quit", self.timing.quit_grace) {
            tracing::debug!(gpu = %self.uuid, %error, "quit not answered");
        }
        if !control::wait_gone(pid, self.timing.quit_grace) {
            control::signal(pid, libc::SIGTERM);
            if !control::wait_gone(pid, self.timing.term_grace) {
                control::signal(pid, libc::SIGKILL);
                control::wait_gone(pid, self.timing.term_grace);
            }
        }
        control::remove_daemon_files(&self.control.pipe);
    }
}

/// How `child` ended, if it did.
fn exited(child: &mut Child) -> Option<String> {
    match child.try_wait() {
        Ok(Some(status)) => Some(format!("exited ({status})")),
        Ok(None) => None,
        Err(error) => Some(format!("cannot be waited for: {error}")),
    }
}

/// The end of a GPU's UUID, for thread names (at most 15 bytes in all).
fn short(uuid: &str) -> &str {
    let start = uuid.len().saturating_sub(8);
    uuid.get(start..).unwrap_or(uuid)
}

/// The stop signal of every supervision thread: waits wake at once on it.
#[derive(Default)]
struct Stop {
    stopped: Mutex<bool>,
    changed: Condvar,
}

impl Stop {
    fn set(&self) {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.changed.notify_all();
    }

    fn is_set(&self) -> bool {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits up to `timeout`; true when stopped.
    fn wait(&self, timeout: Duration) -> bool {
        let guard = self.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |stopped| !*stopped)
            .unwrap_or_else(PoisonError::into_inner);
        *guard
    }
}
