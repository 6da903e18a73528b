//! `nvidia-cuda-mps-control`, the test double (never shipped): `-f` runs
//! the control daemon in the foreground, `-d` starts it in the background,
//! no argument is the client reading commands from stdin. See the crate's
//! documentation for what it fakes.

use std::io::BufReader;
use std::os::unix::net::UnixStream;
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use mps_fake::{FakeError, Hooks, LOG_FILE, SOCKET, client, daemon, log_dir, pipe_dir};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>()
        .as_slice()
    {
        ["-f"] => Hooks::from_env().and_then(|hooks| daemon::run(&pipe_dir(), hooks)),
        ["-d"] => background(),
        [] => client::run(
            &pipe_dir(),
            BufReader::new(std::io::stdin().lock()),
            std::io::stdout().lock(),
        ),
        _ => {
            eprintln!("usage: nvidia-cuda-mps-control [-d | -f]");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("{error}");
            ExitCode::FAILURE
        }
    }
}

/// `-d`: starts `-f` in a session of its own, its log appended to the log
/// folder's [`LOG_FILE`], and returns once it answers.
fn background() -> Result<(), FakeError> {
    use std::os::unix::process::CommandExt;
    let exe = std::env::current_exe().map_err(FakeError::io("find", "itself"))?;
    let path = log_dir().join(LOG_FILE);
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(FakeError::io("open", &path))?;
    Command::new(&exe)
        .arg("-f")
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(FakeError::io("start", exe.clone()))?;
    let socket = pipe_dir().join(SOCKET);
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if UnixStream::connect(&socket).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Err(FakeError::NoDaemon)
}
