//! The fake `nvidia-cuda-mps-control` as the supervisor uses it: a daemon
//! in the foreground with its socket, pid file and log (on stdout, which
//! these tests point at the log folder's file, as the supervisor does);
//! commands through the client mode; `quit` and SIGTERM; a client without a
//! daemon; the test hooks.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use mps_fake::{LOG_FILE, PID_FILE, SERVED_DEVICES_FILE, SOCKET, log};
use system_tests::wait::eventually;

const FAKE: &str = env!("CARGO_BIN_EXE_nvidia-cuda-mps-control");

/// A pipe and a log folder under /tmp, removed when dropped (also when a
/// test fails); a daemon still running is killed first.
struct Dirs {
    root: PathBuf,
    daemon: Option<Child>,
}

impl Dirs {
    fn new() -> Self {
        static N: AtomicUsize = AtomicUsize::new(0);
        let root = std::env::temp_dir().join(format!(
            "mps-fake-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(root.join("pipe")).unwrap();
        std::fs::create_dir_all(root.join("log")).unwrap();
        Self { root, daemon: None }
    }

    fn pipe(&self) -> PathBuf {
        self.root.join("pipe")
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.root.join("log").join(LOG_FILE)).unwrap_or_default()
    }

    fn command(&self) -> Command {
        let mut command = Command::new(FAKE);
        command
            .env("CUDA_MPS_PIPE_DIRECTORY", self.pipe())
            .env("CUDA_MPS_LOG_DIRECTORY", self.root.join("log"));
        command
    }

    /// Starts `-f` and waits until its socket answers.
    fn start(&mut self) {
        self.start_with(&[]);
    }

    /// [`Dirs::start`] with more environment variables.
    fn start_with(&mut self, env: &[(&str, &str)]) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.root.join("log").join(LOG_FILE))
            .unwrap();
        let child = self
            .command()
            .arg("-f")
            .env("CUDA_VISIBLE_DEVICES", "GPU-fake-1")
            .envs(env.iter().copied())
            .stdout(log)
            .spawn()
            .unwrap();
        self.daemon = Some(child);
        eventually("the daemon answers", || {
            std::os::unix::net::UnixStream::connect(self.pipe().join(SOCKET)).is_ok()
        });
    }

    /// Runs the client with `input` on stdin.
    fn client(&self, input: &str) -> Output {
        let mut child = self
            .command()
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(input.as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    fn ask(&self, command: &str) -> String {
        let out = self.client(&format!("{command}\n"));
        assert!(out.status.success(), "{command}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// Waits for the daemon to exit; its status.
    fn wait_exit(&mut self) -> std::process::ExitStatus {
        let child = self.daemon.as_mut().unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                self.daemon = None;
                return status;
            }
            assert!(Instant::now() < deadline, "the daemon did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    fn files_gone(&self) -> bool {
        [SOCKET, PID_FILE, SERVED_DEVICES_FILE]
            .iter()
            .all(|name| !self.pipe().join(name).exists())
    }
}

impl Drop for Dirs {
    fn drop(&mut self) {
        if let Some(mut child) = self.daemon.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

#[test]
fn daemon_answers_keeps_state_and_quits_clean() {
    let mut dirs = Dirs::new();
    dirs.start();
    let pid = dirs.daemon.as_ref().unwrap().id();
    let pid_file = std::fs::read_to_string(dirs.pipe().join(PID_FILE)).unwrap();
    assert_eq!(pid_file.trim(), pid.to_string());
    // The start is logged just after the pid file is written.
    eventually("the start logged", || {
        log::started_env(&dirs.log(), "CUDA_VISIBLE_DEVICES").is_some()
    });
    let text = dirs.log();
    assert_eq!(
        log::started_env(&text, "CUDA_VISIBLE_DEVICES"),
        Some("GPU-fake-1")
    );
    assert_eq!(
        log::started_env(&text, "CUDA_MPS_PIPE_DIRECTORY").map(Path::new),
        Some(dirs.pipe().as_path())
    );
    // The GPUs its servers serve, for the driver double's clients.
    assert_eq!(
        std::fs::read_to_string(dirs.pipe().join(SERVED_DEVICES_FILE)).unwrap(),
        "GPU-fake-1\n"
    );

    assert_eq!(dirs.ask("get_server_list"), "");
    assert_eq!(dirs.ask("get_default_active_thread_percentage"), "100.0\n");
    // Several commands on one stdin, answered in order.
    assert_eq!(
        dirs.ask("set_default_active_thread_percentage 80\nstart_server -uid 0\nget_server_list"),
        "80.0\n4000000\n4000000\n"
    );
    assert_eq!(
        dirs.ask("set_active_thread_percentage 4000000 60\nget_client_list 4000000"),
        "60.0\n"
    );

    assert_eq!(dirs.ask("quit"), "");
    // `quit` returns once the files are gone.
    assert!(dirs.files_gone());
    assert!(dirs.wait_exit().success());
    assert_eq!(
        log::commands(&dirs.log()),
        [
            "get_server_list",
            "get_default_active_thread_percentage",
            "set_default_active_thread_percentage 80",
            "start_server -uid 0",
            "get_server_list",
            "set_active_thread_percentage 4000000 60",
            "get_client_list 4000000",
            "quit"
        ]
    );
}

#[test]
fn sigterm_stops_the_daemon_clean() {
    let mut dirs = Dirs::new();
    dirs.start();
    let pid = dirs.daemon.as_ref().unwrap().id() as i32;
    // SAFETY: signals our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(dirs.wait_exit().success());
    assert!(dirs.files_gone());
    assert!(dirs.log().contains(log::EXITING));
}

#[test]
fn client_without_daemon_fails() {
    let dirs = Dirs::new();
    let out = dirs.client("get_server_list\n");
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(mps_fake::client::NO_DAEMON));
}

#[test]
fn second_daemon_refuses_and_stale_socket_is_replaced() {
    let mut dirs = Dirs::new();
    dirs.start();
    let second = dirs.command().arg("-f").output().unwrap();
    assert_eq!(second.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&second.stderr).contains("already running"));
    // The first one still answers, then dies without cleaning up.
    assert_eq!(dirs.ask("get_server_list"), "");
    let mut child = dirs.daemon.take().unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(dirs.pipe().join(SOCKET).exists());
    dirs.start();
    assert_eq!(dirs.ask("get_server_list"), "");
}

#[test]
fn background_daemon_starts_and_quits() {
    let dirs = Dirs::new();
    let out = dirs.command().arg("-d").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let pid: i32 = std::fs::read_to_string(dirs.pipe().join(PID_FILE))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(dirs.ask("quit"), "");
    assert!(dirs.files_gone());
    // SAFETY: signal 0 only checks that the pid exists.
    eventually("the background daemon exits", || unsafe {
        libc::kill(pid, 0) != 0
    });
    // Its log went to the log folder.
    assert_eq!(log::commands_of(&dirs.log(), pid as u32), ["quit"]);
}

#[test]
fn server_hook_fails_every_server_as_the_real_daemon_logs_it() {
    let mut dirs = Dirs::new();
    dirs.start_with(&[(mps_fake::SERVER_FAILS, "invalid argument")]);
    assert_eq!(dirs.ask("start_server -uid 0"), "");
    assert_eq!(dirs.ask("get_server_list"), "");
    assert_eq!(dirs.ask("quit"), "");
    assert!(dirs.wait_exit().success());
    let text = dirs.log();
    let server = mps_fake::commands::FIRST_SERVER_PID;
    let failed = text
        .find(&format!(
            "Server {server}] {} invalid argument",
            log::FAILED_TO_START
        ))
        .unwrap_or_else(|| panic!("{text}"));
    let exited = text
        .find(&format!("] Server {server} exited with status 1"))
        .unwrap_or_else(|| panic!("{text}"));
    assert!(failed < exited, "{text}");
}

#[test]
fn hang_hook_stops_answers_but_not_the_process() {
    use std::io::Read;
    let mut dirs = Dirs::new();
    dirs.start_with(&[(mps_fake::HANG_AFTER, "2")]);
    // The bare connection of `start` is no command: two are answered.
    assert_eq!(dirs.ask("get_server_list"), "");
    assert_eq!(dirs.ask("get_default_active_thread_percentage"), "100.0\n");
    // The third is taken and held open, never answered.
    let mut stream = std::os::unix::net::UnixStream::connect(dirs.pipe().join(SOCKET)).unwrap();
    stream.write_all(b"get_server_list\n").unwrap();
    stream
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    let mut answer = Vec::new();
    let error = stream.read_to_end(&mut answer).unwrap_err();
    assert_eq!(error.kind(), std::io::ErrorKind::WouldBlock, "{answer:?}");
    assert!(dirs.daemon.as_mut().unwrap().try_wait().unwrap().is_none());
    // SIGTERM still stops it, clean.
    let pid = dirs.daemon.as_ref().unwrap().id() as i32;
    // SAFETY: signals our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert!(dirs.wait_exit().success());
    assert!(dirs.files_gone());
    assert_eq!(
        log::commands(&dirs.log()),
        ["get_server_list", "get_default_active_thread_percentage"]
    );
}

#[test]
fn hang_hook_that_is_no_number_is_refused() {
    let dirs = Dirs::new();
    let out = dirs
        .command()
        .arg("-f")
        .env(mps_fake::HANG_AFTER, "soon")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains(mps_fake::HANG_AFTER));
}
