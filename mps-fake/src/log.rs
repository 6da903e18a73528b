//! The daemon's log, `control.log`: lines as the real one writes them,
//! `[<time> Control <pid>] <message>`, with the messages tests look for.

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// Starts the line written at start, followed by the environment
/// (`NAME=value` separated by spaces).
pub const STARTED: &str = "Starting control daemon";
/// Starts the line written for each command, followed by the command.
pub const COMMAND: &str = "Command:";
/// The line written when the daemon stops.
pub const EXITING: &str = "Exiting control daemon";

/// The environment variables the start line records.
pub const RECORDED_ENV: [&str; 3] = [
    "CUDA_VISIBLE_DEVICES",
    "CUDA_MPS_PIPE_DIRECTORY",
    "CUDA_MPS_LOG_DIRECTORY",
];

/// Appends lines to `<dir>/control.log`, best effort: a daemon whose log
/// folder is gone goes on answering.
pub struct Log {
    path: PathBuf,
    pid: u32,
}

impl Log {
    pub fn new(dir: &Path) -> Self {
        Self {
            path: dir.join(crate::LOG_FILE),
            pid: std::process::id(),
        }
    }

    pub fn line(&self, message: &str) {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let line = format!(
            "[{}.{:03} Control {}] {message}\n",
            now.as_secs(),
            now.subsec_millis(),
            self.pid
        );
        if let Ok(mut file) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.path)
        {
            let _ = file.write_all(line.as_bytes());
        }
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

/// The value of `name` on the last start line of a log's `text`.
pub fn started_env<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let line = text.lines().rev().find(|l| l.contains(STARTED))?;
    let prefix = format!("{name}=");
    line.split(' ')
        .find_map(|word| word.strip_prefix(prefix.as_str()))
}

/// The commands a log's `text` records, in order.
pub fn commands(text: &str) -> Vec<&str> {
    text.lines()
        .filter_map(|l| Some(l.split_once(COMMAND)?.1.trim()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_read_back() {
        let text = "[1.000 Control 7] Starting control daemon CUDA_VISIBLE_DEVICES=GPU-1 \
                    CUDA_MPS_PIPE_DIRECTORY=/p CUDA_MPS_LOG_DIRECTORY=/l\n\
                    [1.001 Control 7] Command: get_server_list\n\
                    [1.002 Control 7] Command: quit\n";
        assert_eq!(started_env(text, "CUDA_VISIBLE_DEVICES"), Some("GPU-1"));
        assert_eq!(started_env(text, "CUDA_MPS_PIPE_DIRECTORY"), Some("/p"));
        assert_eq!(commands(text), ["get_server_list", "quit"]);
    }
}
