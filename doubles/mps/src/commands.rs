//! The commands the fake daemon answers, as plain state: one line in, the
//! answer out. Answers follow the real program's shapes: a percentage with
//! one decimal (`100.0`), server pids one per line, nothing for an empty
//! list.

use std::collections::BTreeMap;

/// What the daemon does after a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Send this text back (may be empty).
    Answer(String),
    /// Stop: remove the socket and the pid file, exit 0.
    Quit,
    /// A server was started and failed to (the test hook
    /// [`crate::SERVER_FAILS`]): log it, answer nothing.
    ServerFailed {
        /// The fake server's number.
        server: u32,
        /// The user it was started for.
        uid: u32,
        /// The line it failed with.
        reason: String,
    },
}

/// A fake MPS server: a number, not a process.
#[derive(Debug, Clone, PartialEq)]
pub struct Server {
    /// The user whose clients it serves.
    pub uid: u32,
    /// The share of the SMs its new clients get, in percent.
    pub active_thread_percentage: f64,
}

/// The daemon's state.
#[derive(Debug, Clone, PartialEq)]
pub struct Control {
    default_percentage: f64,
    servers: BTreeMap<u32, Server>,
    next_server: u32,
    /// Why every server fails to start, if they do.
    server_fails: Option<String>,
}

/// Where fake server pids start: far above the daemon's own pid range in
/// tests, so a reader never mistakes one for a process.
pub const FIRST_SERVER_PID: u32 = 4_000_000;

impl Default for Control {
    fn default() -> Self {
        Self {
            default_percentage: 100.0,
            servers: BTreeMap::new(),
            next_server: FIRST_SERVER_PID,
            server_fails: None,
        }
    }
}

impl Control {
    /// A daemon whose servers all fail to start, for `reason`.
    pub fn with_failing_servers(reason: impl Into<String>) -> Self {
        Self {
            server_fails: Some(reason.into()),
            ..Self::default()
        }
    }

    /// Answers one command line.
    pub fn handle(&mut self, line: &str) -> Outcome {
        let words: Vec<&str> = line.split_whitespace().collect();
        let answer = match words.as_slice() {
            ["quit"] | ["quit", "-t", _] => return Outcome::Quit,
            ["get_server_list"] => self.servers.keys().map(|pid| format!("{pid}\n")).collect(),
            ["start_server", "-uid", uid] => match uid.parse() {
                Ok(uid) => return self.start_server(uid),
                Err(_) => format!("Invalid user id {uid}\n"),
            },
            ["shutdown_server", pid] | ["shutdown_server", pid, "-f"] => {
                match self.server_pid(pid) {
                    Some(pid) => {
                        self.servers.remove(&pid);
                        String::new()
                    }
                    None => format!("Server {pid} not found\n"),
                }
            }
            // The fake's servers never have clients.
            ["get_client_list", pid] => match self.server_pid(pid) {
                Some(_) => String::new(),
                None => format!("Server {pid} not found\n"),
            },
            ["get_default_active_thread_percentage"] => percent(self.default_percentage),
            ["set_default_active_thread_percentage", value] => match parse_percentage(value) {
                Some(value) => {
                    self.default_percentage = value;
                    percent(value)
                }
                None => format!("Invalid percentage {value}\n"),
            },
            ["get_active_thread_percentage", pid] => match self.server_pid(pid) {
                Some(pid) => percent(self.servers[&pid].active_thread_percentage),
                None => format!("Server {pid} not found\n"),
            },
            ["set_active_thread_percentage", pid, value] => {
                match (self.server_pid(pid), parse_percentage(value)) {
                    (None, _) => format!("Server {pid} not found\n"),
                    (_, None) => format!("Invalid percentage {value}\n"),
                    (Some(pid), Some(value)) => {
                        if let Some(server) = self.servers.get_mut(&pid) {
                            server.active_thread_percentage = value;
                        }
                        percent(value)
                    }
                }
            }
            _ => format!("Unrecognized command: {line}\n"),
        };
        Outcome::Answer(answer)
    }

    /// The fake servers by pid.
    pub fn servers(&self) -> &BTreeMap<u32, Server> {
        &self.servers
    }

    fn start_server(&mut self, uid: u32) -> Outcome {
        // One server per user at a time, as the real daemon.
        if let Some((pid, _)) = self.servers.iter().find(|(_, s)| s.uid == uid) {
            return Outcome::Answer(format!("{pid}\n"));
        }
        let pid = self.next_server;
        self.next_server += 1;
        if let Some(reason) = &self.server_fails {
            return Outcome::ServerFailed {
                server: pid,
                uid,
                reason: reason.clone(),
            };
        }
        self.servers.insert(
            pid,
            Server {
                uid,
                active_thread_percentage: self.default_percentage,
            },
        );
        Outcome::Answer(format!("{pid}\n"))
    }

    fn server_pid(&self, word: &str) -> Option<u32> {
        word.parse()
            .ok()
            .filter(|pid| self.servers.contains_key(pid))
    }
}

fn parse_percentage(word: &str) -> Option<f64> {
    word.parse::<f64>().ok().filter(|v| *v > 0.0 && *v <= 100.0)
}

fn percent(value: f64) -> String {
    format!("{value:.1}\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(control: &mut Control, line: &str) -> String {
        match control.handle(line) {
            Outcome::Answer(text) => text,
            other => panic!("{line}: {other:?}"),
        }
    }

    #[test]
    fn commands_keep_their_state() {
        let mut c = Control::default();
        let table = [
            ("get_server_list", ""),
            ("get_default_active_thread_percentage", "100.0\n"),
            ("set_default_active_thread_percentage 80", "80.0\n"),
            ("get_default_active_thread_percentage", "80.0\n"),
            (
                "set_default_active_thread_percentage 0",
                "Invalid percentage 0\n",
            ),
            (
                "set_default_active_thread_percentage x",
                "Invalid percentage x\n",
            ),
            ("start_server -uid 1000", "4000000\n"),
            ("start_server -uid 1000", "4000000\n"),
            ("get_server_list", "4000000\n"),
            ("get_active_thread_percentage 4000000", "80.0\n"),
            ("set_active_thread_percentage 4000000 50", "50.0\n"),
            ("get_active_thread_percentage 4000000", "50.0\n"),
            ("set_active_thread_percentage 7 50", "Server 7 not found\n"),
            ("get_client_list 4000000", ""),
            ("get_client_list 7", "Server 7 not found\n"),
            ("shutdown_server 4000000", ""),
            ("get_server_list", ""),
            ("frobnicate", "Unrecognized command: frobnicate\n"),
        ];
        for (line, expected) in table {
            assert_eq!(answer(&mut c, line), expected, "{line}");
        }
        assert_eq!(c.handle("quit"), Outcome::Quit);
    }

    #[test]
    fn failing_servers_are_never_listed() {
        let mut c = Control::with_failing_servers("invalid argument");
        let failed = |server| Outcome::ServerFailed {
            server,
            uid: 0,
            reason: "invalid argument".into(),
        };
        assert_eq!(c.handle("start_server -uid 0"), failed(FIRST_SERVER_PID));
        assert_eq!(
            c.handle("start_server -uid 0"),
            failed(FIRST_SERVER_PID + 1)
        );
        assert_eq!(answer(&mut c, "get_server_list"), "");
    }
}
