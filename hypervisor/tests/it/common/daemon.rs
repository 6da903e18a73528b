//! The `hypervisor` binary as a child of the test: started on a config file,
//! perhaps as another user, killed with the test, and the address it says
//! it listens on.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use super::{ConfigFile, use_node_tables};

/// The binary cargo built for these tests.
pub(crate) fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_hypervisor")
}

/// Kills (and reaps) the child when dropped (a test that failed half-way).
pub(crate) struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `hypervisor serve` on `config`'s file with one simulated GPU, making the
/// config's node tables.
pub(crate) fn serve(config: &ConfigFile) -> Command {
    let mut command = Command::new(bin());
    command
        .args(["serve", "--config"])
        .arg(&config.path)
        .args(["--simulate-gpus", "1"]);
    use_node_tables(&mut command, &config.path);
    command
}

/// Spawns `command` (a [`serve`], perhaps through `as_uid`) with its
/// stdout piped and reads its first line, `hypervisor listening on ADDR`:
/// the daemon and ADDR.
pub(crate) fn listening(mut command: Command) -> (Killed, String) {
    let mut daemon = Killed(
        command
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn hypervisor"),
    );
    let mut line = String::new();
    BufReader::new(daemon.0.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    let addr = line
        .trim()
        .strip_prefix("hypervisor listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    (daemon, addr)
}
