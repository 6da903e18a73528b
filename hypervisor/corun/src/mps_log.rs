//! What an MPS control daemon and its servers say, and what of it the
//! node daemon reports.
//!
//! In the foreground (`-f`, as the supervisor runs it) the control daemon
//! writes its log lines and its servers' to stdout, none to its log
//! folder: `[<date> <time> <source> <pid>] <message>`, the source `Control`
//! for the daemon, `Other` then `Server` for a server. The supervisor points
//! the daemon's stdout and stderr at [`LOG_FILE`] in the GPU's log folder,
//! where operators look for MPS logs, and reads the file as it grows
//! ([`LogTail`]). A server that exits with a failure status took its
//! clients with it, and one that fails to start refuses them: their
//! `cuInit` fails (`CUDA_ERROR_MPS_CONNECTION_FAILED`, measured on the H100
//! with a server that could not start), the driver runs none of them
//! without MPS. [`ServerWatch`] finds those exits and the server's last
//! line, its reason ("Failed to start : invalid argument").

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The daemon's log (its servers' lines too) in the GPU's log folder.
pub const LOG_FILE: &str = "control.log";

/// The size past which the log is copied to `control.log.1` and emptied.
pub const LOG_CAP: u64 = 4 << 20;

/// The most one read takes from the log; the rest waits for the next.
const READ_MAX: u64 = 1 << 20;

/// One line of the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Line<'a> {
    /// `Control`, `Server` or `Other`.
    pub source: &'a str,
    /// Pid of the process that wrote the line: the control daemon, or the
    /// server whose line it is.
    pub pid: u32,
    /// The text after the bracketed header, without its leading space.
    pub message: &'a str,
}

impl<'a> Line<'a> {
    /// `[<time> <source> <pid>] <message>`; `None` for any other shape.
    pub fn parse(text: &'a str) -> Option<Self> {
        let (head, message) = text.strip_prefix('[')?.split_once(']')?;
        let mut words = head.split_whitespace().rev();
        let pid = words.next()?.parse().ok()?;
        let source = words.next()?;
        Some(Self {
            source,
            pid,
            message: message.strip_prefix(' ').unwrap_or(message),
        })
    }
}

/// An MPS server that exited with a failure status.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ServerFailure {
    /// The server's pid.
    pub server: u32,
    /// Its exit status.
    pub status: i32,
    /// The last line it wrote, if any.
    pub reason: Option<String>,
}

impl std::fmt::Display for ServerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MPS server {} exited with status {}",
            self.server, self.status
        )?;
        match &self.reason {
            Some(reason) => write!(f, ": {reason}"),
            None => Ok(()),
        }
    }
}

/// Follows servers through the log: each one's last line until the daemon
/// notes its exit.
#[derive(Debug, Default)]
pub struct ServerWatch {
    last: std::collections::HashMap<u32, String>,
}

/// Servers whose exit the log never notes (their daemon was killed) are
/// forgotten past this many.
const SERVERS_FOLLOWED: usize = 64;

impl ServerWatch {
    /// Takes in one line; a failure when it notes a server's exit with a
    /// status other than 0.
    pub fn see(&mut self, line: &Line<'_>) -> Option<ServerFailure> {
        if line.source != "Control" {
            if self.last.len() >= SERVERS_FOLLOWED && !self.last.contains_key(&line.pid) {
                self.last.clear();
            }
            self.last.insert(line.pid, line.message.to_owned());
            return None;
        }
        let (server, status) = server_exit(line.message)?;
        let reason = self.last.remove(&server);
        (status != 0).then_some(ServerFailure {
            server,
            status,
            reason,
        })
    }
}

/// `Server <pid> exited with status <n>`.
fn server_exit(message: &str) -> Option<(u32, i32)> {
    let (pid, rest) = message.strip_prefix("Server ")?.split_once(' ')?;
    let status = rest.strip_prefix("exited with status ")?;
    Some((pid.parse().ok()?, status.trim().parse().ok()?))
}

/// Reads the lines a log file gains, and keeps it under [`LOG_CAP`].
#[derive(Debug)]
pub struct LogTail {
    path: PathBuf,
    cap: u64,
    /// Where the next read starts.
    offset: u64,
    /// The start of a line not ended yet.
    partial: Vec<u8>,
}

impl LogTail {
    /// Follows `path` from its current end: lines of an earlier run are
    /// not reported again.
    pub fn from_end(path: &Path) -> Self {
        Self::with_cap(path, LOG_CAP)
    }

    /// [`LogTail::from_end`] with another cap.
    pub fn with_cap(path: &Path, cap: u64) -> Self {
        let offset = std::fs::metadata(path).map_or(0, |m| m.len());
        Self {
            path: path.to_owned(),
            cap,
            offset,
            partial: Vec::new(),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The complete lines written since the last call (a missing file has
    /// none). A file grown past the cap is then copied to `<name>.1` and
    /// emptied: its writer appends (`O_APPEND`) and goes on at its start. A
    /// line written between the copy and the emptying is lost.
    pub fn read(&mut self) -> std::io::Result<Vec<String>> {
        let mut file = match File::open(&self.path) {
            Ok(file) => file,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(error) => return Err(error),
        };
        let len = file.metadata()?.len();
        if len < self.offset {
            // Emptied by someone else: start over.
            self.offset = 0;
            self.partial.clear();
        }
        file.seek(SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        file.take(READ_MAX).read_to_end(&mut bytes)?;
        self.offset += bytes.len() as u64;
        self.partial.extend_from_slice(&bytes);
        let lines = match self.partial.iter().rposition(|&b| b == b'\n') {
            Some(end) => {
                let rest = self.partial.split_off(end + 1);
                let done = std::mem::replace(&mut self.partial, rest);
                String::from_utf8_lossy(&done)
                    .lines()
                    .map(str::to_owned)
                    .collect()
            }
            None => Vec::new(),
        };
        // Only once every byte seen was read: none is left unparsed.
        if self.offset > self.cap && self.offset >= len {
            self.rotate()?;
        }
        Ok(lines)
    }

    fn rotate(&mut self) -> std::io::Result<()> {
        let mut old = self.path.clone().into_os_string();
        old.push(".1");
        std::fs::copy(&self.path, &old)?;
        std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)?
            .set_len(0)?;
        self.offset = 0;
        Ok(())
    }
}

/// One GPU's log as the supervisor follows it: the file's new lines, and
/// the servers in them.
#[derive(Debug)]
pub struct DaemonLog {
    tail: LogTail,
    servers: ServerWatch,
}

impl DaemonLog {
    /// Follows `<log folder>/control.log` from its current end.
    pub fn follow(folder: &Path) -> Self {
        Self {
            tail: LogTail::from_end(&folder.join(LOG_FILE)),
            servers: ServerWatch::default(),
        }
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        self.tail.path()
    }

    /// The server failures the lines written since the last call note.
    pub fn failures(&mut self) -> std::io::Result<Vec<ServerFailure>> {
        let lines = self.tail.read()?;
        Ok(lines
            .iter()
            .filter_map(|text| Line::parse(text))
            .filter_map(|line| self.servers.see(&line))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// A failure and a clean run as the real daemon logged them on the
    /// H100 (its server could not start with the L2 set-aside asked).
    const REAL: &str = "\
[2026-11-26 00:58:09.209 Control   543] NEW CLIENT 548 from user 0: Server is not ready, push client to pending list
[2026-11-26 00:58:09.209 Control   550] Starting new server 550 for user 0
[2026-11-26 00:58:09.212 Other   550] Startup
[2026-11-26 00:58:09.355 Server   550] Creating server context on device 0 (NVIDIA H100 80GB HBM3)
[2026-11-26 00:58:09.473 Server   550] Failed to start : invalid argument
[2026-11-26 00:58:09.473 Control   543] Server encountered a fatal exception. Shutting down
[2026-11-26 00:58:09.553 Control   543] Server 550 exited with status 1
[2026-11-26 00:58:07.894 Server   520] Server has started
[2026-11-26 00:58:08.046 Server   520] Exiting
[2026-11-26 00:58:08.120 Control   509] Server 520 exited with status 0
not a log line
";

    #[test]
    fn lines_parse_with_their_source_and_pid() {
        let line = Line::parse("[2026-11-26 00:58:09.212 Other   550] Startup").unwrap();
        assert_eq!(
            line,
            Line {
                source: "Other",
                pid: 550,
                message: "Startup"
            }
        );
        assert_eq!(Line::parse("[1.5 Control 7]").unwrap().message, "");
        assert_eq!(Line::parse("no bracket"), None);
        assert_eq!(Line::parse("[no pid] x"), None);
    }

    #[test]
    fn a_server_that_exits_failing_is_reported_with_its_last_line() {
        let mut watch = ServerWatch::default();
        let failures: Vec<_> = REAL
            .lines()
            .filter_map(Line::parse)
            .filter_map(|l| watch.see(&l))
            .collect();
        assert_eq!(
            failures,
            [ServerFailure {
                server: 550,
                status: 1,
                reason: Some("Failed to start : invalid argument".into()),
            }]
        );
        assert_eq!(
            failures[0].to_string(),
            "MPS server 550 exited with status 1: Failed to start : invalid argument"
        );
        // Both exits forgot their server.
        assert!(watch.last.is_empty());
    }

    #[test]
    fn servers_never_seen_exiting_are_forgotten() {
        let mut watch = ServerWatch::default();
        for pid in 0..200 {
            watch.see(&Line {
                source: "Server",
                pid,
                message: "Startup",
            });
        }
        assert!(watch.last.len() <= SERVERS_FOLLOWED);
    }

    /// A folder of the test's own, removed when dropped.
    fn scratch(name: &str) -> tempfile::TempDir {
        tempfile::Builder::new()
            .prefix(&format!("mps-log-{name}"))
            .tempdir()
            .unwrap()
    }

    fn append(path: &Path, text: &str) {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        file.write_all(text.as_bytes()).unwrap();
    }

    #[test]
    fn the_tail_reads_whole_new_lines_only() {
        let dir = scratch("tail");
        let path = dir.path().join(LOG_FILE);
        append(&path, "from an earlier run\n");
        let mut tail = LogTail::from_end(&path);
        assert!(tail.read().unwrap().is_empty());
        append(&path, "one\ntw");
        assert_eq!(tail.read().unwrap(), ["one"]);
        append(&path, "o\nthree\n");
        assert_eq!(tail.read().unwrap(), ["two", "three"]);
        assert!(tail.read().unwrap().is_empty());
        let mut missing = LogTail::from_end(&dir.path().join("none"));
        assert!(missing.read().unwrap().is_empty());
    }

    #[test]
    fn a_full_log_is_kept_once_and_emptied_while_its_writer_appends() {
        let dir = scratch("rotate");
        let path = dir.path().join(LOG_FILE);
        // The daemon's side: one append-mode handle for its life.
        let mut writer = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let mut tail = LogTail::with_cap(&path, 64);
        writer.write_all(&[b'x'; 70]).unwrap();
        writer.write_all(b"\n").unwrap();
        assert_eq!(tail.read().unwrap(), ["x".repeat(70)]);
        let old = std::fs::read_to_string(dir.path().join("control.log.1")).unwrap();
        assert_eq!(old.len(), 71);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 0);
        writer.write_all(b"after\n").unwrap();
        assert_eq!(tail.read().unwrap(), ["after"]);
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "after\n");
    }
}
