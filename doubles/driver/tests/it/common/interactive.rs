//! A probe program the test talks to line by line: its stdout read by a
//! thread of its own, so a reply can be awaited with a bound (or shown not
//! to come); the process is killed when dropped.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc::{Receiver, channel};
use std::time::Duration;

pub(crate) struct Interactive {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    /// How long a reply that must come may take.
    wait: Duration,
}

impl Interactive {
    /// Starts `cmd` with its stdin and stdout piped; [`Self::line`] waits
    /// at most `wait`.
    pub(crate) fn spawn(mut cmd: Command, wait: Duration) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start the probe");
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in stdout.lines() {
                let Ok(line) = line else { break };
                if send.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
            wait,
        }
    }

    /// The process's pid.
    pub(crate) fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Reads `ckptprobe`'s first line, `ready pid=N`, and checks N is this
    /// process.
    pub(crate) fn ready(&self) {
        let ready = self.line();
        let pid = ready
            .strip_prefix("ready pid=")
            .and_then(|pid| pid.parse::<i32>().ok())
            .unwrap_or_else(|| panic!("{ready}"));
        assert_eq!(pid, self.pid());
    }

    /// One line on stdin: a `wait` of cudaprobe resumes, ckptprobe runs it.
    pub(crate) fn send(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write to the probe");
        stdin.flush().expect("flush the probe's stdin");
    }

    /// The next line, if one comes within `wait`.
    pub(crate) fn reply(&self, wait: Duration) -> Option<String> {
        self.lines.recv_timeout(wait).ok()
    }

    /// The next line, which must come.
    pub(crate) fn line(&self) -> String {
        self.reply(self.wait).expect("a line from the probe")
    }

    /// Sends `line`, returns the reply.
    pub(crate) fn ask(&mut self, line: &str) -> String {
        self.send(line);
        self.reply(self.wait)
            .unwrap_or_else(|| panic!("no reply to {line}"))
    }

    /// Asserts the next lines.
    pub(crate) fn expect(&self, lines: &[&str]) {
        for want in lines {
            assert_eq!(self.line(), *want);
        }
    }

    /// Reaps the process once it ended.
    pub(crate) fn wait(&mut self) -> ExitStatus {
        self.child.wait().expect("wait for the probe")
    }

    /// Closes stdin and waits for a normal exit.
    pub(crate) fn finish(mut self) {
        drop(self.stdin.take());
        let status = self.wait();
        assert!(status.success(), "{status:?}");
    }

    /// SIGKILL, and reaped.
    pub(crate) fn kill(mut self) {
        self.child.kill().expect("kill the probe");
        self.wait();
    }
}

impl Drop for Interactive {
    fn drop(&mut self) {
        let _ = self.child.kill(); // it may have exited already
        let _ = self.child.wait();
    }
}
