//! The daemon's log: lines as the real one writes them,
//! `[<time> <source> <pid>] <message>` (source `Control` for the daemon,
//! `Server` for one of its servers; the pid right-aligned in five columns),
//! with the messages tests look for. As the real daemon in the foreground
//! (`-f`), the fake writes its lines and its servers' to stdout; `-d`
//! points that at [`crate::LOG_FILE`] in the log folder (the real one
//! writes its servers' lines to `server.log` there; the fake keeps one
//! file).

use std::io::Write as _;
use std::time::{SystemTime, UNIX_EPOCH};

/// Starts the line written at start, followed by the environment
/// (`NAME=value` separated by spaces).
pub const STARTED: &str = "Starting control daemon";
/// Starts the line written for each command, followed by the command.
pub const COMMAND: &str = "Command:";
/// The line written when the daemon stops.
pub const EXITING: &str = "Exiting control daemon";
/// What a server that failed to start last says (the real server's words),
/// followed by the reason.
pub const FAILED_TO_START: &str = "Failed to start :";

/// The environment variables the start line records.
pub const RECORDED_ENV: [&str; 3] = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
];

/// Writes the daemon's lines to stdout, best effort: a daemon whose
/// reader is gone goes on answering.
pub struct Log {
    pid: u32,
}

impl Default for Log {
    fn default() -> Self {
        Self {
            pid: std::process::id(),
        }
    }
}

impl Log {
    /// A line of the daemon's own.
    pub fn line(&self, message: &str) {
        write("Control", self.pid, message);
    }

    /// A line of server `server`'s.
    pub fn server_line(&self, server: u32, message: &str) {
        write("Server", server, message);
    }

    /// What the real daemon writes when a server it started fails to:
    /// the server's reason, then the daemon's notice of its exit.
    pub fn server_failed(&self, server: u32, uid: u32, reason: &str) {
        write(
            "Control",
            server,
            &format!("Starting new server {server} for user {uid}"),
        );
        self.server_line(server, &format!("{FAILED_TO_START} {reason}"));
        self.line("Server encountered a fatal exception. Shutting down");
        self.line(&format!("Server {server} exited with status 1"));
    }

    /// The start line: [`STARTED`] and the [`RECORDED_ENV`] values.
    pub fn started(&self) {
        let mut message = STARTED.to_owned();
        for name in RECORDED_ENV {
            let value = std::env::var(name).unwrap_or_default();
            message.push_str(&format!(" {name}={value}"));
        }
        self.line(&message);
    }
}

fn write(source: &str, pid: u32, message: &str) {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let line = format!(
        "[{}.{:03} {source} {pid:>5}] {message}\n",
        now.as_secs(),
        now.subsec_millis(),
    );
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(line.as_bytes()).and_then(|()| out.flush());
}

/// The commands a log's `text` records as received by daemon `pid`.
pub fn commands_of(text: &str, pid: u32) -> Vec<&str> {
    text.lines()
        .filter(|l| {
            let head = l.split_once(']').map(|(head, _)| head);
            head.and_then(|h| h.split_whitespace().last()?.parse().ok()) == Some(pid)
        })
        .filter_map(command)
        .collect()
}

/// The value of `name` on the last start line of a log's `text`.
pub fn started_env<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let line = text.lines().rev().find(|l| l.contains(STARTED))?;
    let prefix = format!("{name}=");
    line.split(' ')
        .find_map(|word| word.strip_prefix(prefix.as_str()))
}

/// The commands a log's `text` records, in order.
pub fn commands(text: &str) -> Vec<&str> {
    text.lines().filter_map(command).collect()
}

/// The command a log line records, if it records one.
fn command(line: &str) -> Option<&str> {
    Some(line.split_once(COMMAND)?.1.trim())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_back() {
        let text = "[1.000 Control     7] Starting control daemon CUDA_VISIBLE_DEVICES=GPU-1 \
                    CUDA_MPS_PIPE_DIRECTORY=/p CUDA_MPS_LOG_DIRECTORY=/l\n\
                    [1.001 Control     7] Command: get_server_list\n\
                    [1.002 Control    77] Command: start_server -uid 0\n\
                    [1.003 Control     7] Command: quit\n";
        assert_eq!(started_env(text, "CUDA_VISIBLE_DEVICES"), Some("GPU-1"));
        assert_eq!(started_env(text, "CUDA_MPS_PIPE_DIRECTORY"), Some("/p"));
        assert_eq!(
            commands(text),
            ["get_server_list", "start_server -uid 0", "quit"]
        );
        assert_eq!(commands_of(text, 7), ["get_server_list", "quit"]);
    }
}
