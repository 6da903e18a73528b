//! The fake control daemon: the socket, the pid file, the log, and the loop
//! that answers one command per connection until `quit` or a signal.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::commands::{Control, Outcome};
use crate::log::{self, Log};
use crate::{FakeError, Hooks, PID_FILE, SERVED_DEVICES_FILE, SOCKET};

/// Set by SIGTERM and SIGINT; the loop stops when it sees it.
static STOP: AtomicBool = AtomicBool::new(false);

/// How often the loop looks at [`STOP`] while no client connects.
const IDLE: Duration = Duration::from_millis(10);

/// How long a client may take to send its command.
const READ_TIMEOUT: Duration = Duration::from_secs(5);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// The daemon's files, removed when it stops.
struct Files {
    socket: PathBuf,
    pid: PathBuf,
    served: PathBuf,
}

impl Drop for Files {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket);
        let _ = std::fs::remove_file(&self.pid);
        let _ = std::fs::remove_file(&self.served);
    }
}

/// Writes [`SERVED_DEVICES_FILE`]: the GPUs this daemon's servers serve,
/// its `CUDA_VISIBLE_DEVICES` as started (the driver double's clients then
/// enumerate those alone); none where the variable is unset (every GPU).
/// Before the socket exists, so a client that connects finds it.
fn write_served(pipe: &Path) -> Result<PathBuf, FakeError> {
    let served = pipe.join(SERVED_DEVICES_FILE);
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(devices) => {
            let staged = pipe.join(format!("{SERVED_DEVICES_FILE}.new"));
            std::fs::write(&staged, format!("{devices}\n"))
                .and_then(|()| std::fs::rename(&staged, &served))
                .map_err(FakeError::io("write", served.clone()))?;
        }
        Err(_) => {
            let _ = std::fs::remove_file(&served);
        }
    }
    Ok(served)
}

/// Runs the daemon in the foreground until `quit`, SIGTERM or SIGINT,
/// its log on stdout; with the test hooks of `hooks`.
pub fn run(pipe: &Path, hooks: Hooks) -> Result<(), FakeError> {
    // Before the socket exists: whoever sees it may signal at once, and the
    // signal must find the handler, not the default (death without cleanup).
    // SAFETY: the handler only stores to an atomic, which is
    // async-signal-safe; `signal` has no other precondition.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let log = Log::default();
    let socket = pipe.join(SOCKET);
    if UnixStream::connect(&socket).is_ok() {
        return Err(FakeError::AlreadyRunning(socket));
    }
    // A socket nobody answers on is left by a daemon that died.
    let _ = std::fs::remove_file(&socket);
    // The pid file is complete before the socket exists: whoever found the
    // socket answering (`-d` returns then) may read it at once. Written
    // aside and renamed, so no reader ever sees it empty.
    let pid = pipe.join(PID_FILE);
    let staged = pipe.join(format!("{PID_FILE}.new"));
    std::fs::write(&staged, format!("{}\n", std::process::id()))
        .and_then(|()| std::fs::rename(&staged, &pid))
        .map_err(FakeError::io("write", pid.clone()))?;
    let served = write_served(pipe).inspect_err(|_| {
        let _ = std::fs::remove_file(&pid);
    })?;
    let listener = UnixListener::bind(&socket).map_err(|error| {
        let _ = std::fs::remove_file(&pid);
        let _ = std::fs::remove_file(&served);
        FakeError::io("bind", socket.clone())(error)
    })?;
    let files = Files {
        socket,
        pid,
        served,
    };
    log.started();
    listener
        .set_nonblocking(true)
        .map_err(FakeError::io("configure", files.socket.clone()))?;
    let mut control = match hooks.server_fails {
        Some(reason) => Control::with_failing_servers(reason),
        None => Control::default(),
    };
    let hang_after = hooks.hang_after;
    // The connection that sent `quit`: answered (closed) once the files are
    // gone, so a client that sent it finds the folder clean when it returns.
    let mut quitting = None;
    let mut answered: u64 = 0;
    // Connections a hung daemon took and never answers: held open, so
    // their clients wait as they would on a hung real daemon.
    let mut unanswered = Vec::new();
    while !STOP.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) if hang_after.is_some_and(|n| answered >= n) => {
                unanswered.push(stream);
            }
            Ok((stream, _)) => {
                let served = serve(stream, &mut control, &log);
                answered += u64::from(served.answered);
                quitting = served.quitting;
                if quitting.is_some() {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(IDLE),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(FakeError::io("accept on", &files.socket)(e)),
        }
    }
    log.line(log::EXITING);
    drop(files);
    drop(quitting);
    drop(unanswered);
    Ok(())
}

/// What serving one connection did.
#[derive(Default)]
struct Served {
    /// A command was answered (counts toward [`crate::HANG_AFTER`]).
    answered: bool,
    /// The stream of a `quit`, answered once the files are gone.
    quitting: Option<UnixStream>,
}

/// Answers the one command of `stream`.
fn serve(stream: UnixStream, control: &mut Control, log: &Log) -> Served {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(READ_TIMEOUT));
    let mut line = String::new();
    if BufReader::new(&stream).read_line(&mut line).is_err() {
        return Served::default();
    }
    let line = line.trim();
    // A bare connection: someone checking that the daemon is there.
    if line.is_empty() {
        return Served::default();
    }
    log.line(&format!("{} {line}", log::COMMAND));
    match control.handle(line) {
        Outcome::Answer(text) => {
            let _ = (&stream).write_all(text.as_bytes());
            Served {
                answered: true,
                quitting: None,
            }
        }
        Outcome::Quit => Served {
            answered: false,
            quitting: Some(stream),
        },
        Outcome::ServerFailed {
            server,
            uid,
            reason,
        } => {
            log.server_failed(server, uid, &reason);
            Served {
                answered: true,
                quitting: None,
            }
        }
    }
}
