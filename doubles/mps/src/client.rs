//! Client mode: each line of stdin is sent to the daemon on a connection of
//! its own, and the answer printed.

use std::io::{BufRead, Read, Write};
use std::net::Shutdown;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use crate::{FakeError, SOCKET};

/// What the client prints on stderr when no daemon answers (the real
/// program's words).
pub const NO_DAEMON: &str = "Cannot find MPS control daemon process";

/// How long an answer may take.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Sends one command to the daemon of `pipe` and returns its answer.
pub fn send(pipe: &Path, command: &str) -> Result<String, FakeError> {
    let socket = pipe.join(SOCKET);
    let mut stream = UnixStream::connect(&socket).map_err(|_| FakeError::NoDaemon)?;
    let io = |e| FakeError::io("talk to", &socket)(e);
    stream.set_read_timeout(Some(ANSWER_TIMEOUT)).map_err(io)?;
    stream
        .write_all(format!("{command}\n").as_bytes())
        .map_err(io)?;
    stream.shutdown(Shutdown::Write).map_err(io)?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).map_err(io)?;
    Ok(answer)
}

/// Sends every non-empty line of `input`, writing the answers to `out`.
pub fn run(pipe: &Path, input: impl BufRead, mut out: impl Write) -> Result<(), FakeError> {
    for line in input.lines() {
        let line = line.map_err(FakeError::io("read", "stdin"))?;
        let command = line.trim();
        if command.is_empty() {
            continue;
        }
        let answer = send(pipe, command)?;
        out.write_all(answer.as_bytes())
            .map_err(FakeError::io("write", "stdout"))?;
    }
    Ok(())
}
