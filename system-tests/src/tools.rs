//! The tools the test command installs under `<target>/tools/`: a Python
//! virtual environment (`python/`: kubectl, the Kubernetes client,
//! kubernetes-validate, zig, cargo-zigbuild, pytest).
//! [`command`] finds them before the machine's own, also when the tests
//! run by plain `cargo test` rather than through `scripts/test.sh`.

use std::ffi::{OsStr, OsString};
use std::path::PathBuf;
use std::process::Command;

use crate::artifacts::target_dir;

/// The folder of the installed tools' programs, searched first.
fn programs() -> PathBuf {
    target_dir().join("tools/python/bin")
}

/// `program` (`python3`, `kubectl`, a script that runs them) with the
/// installed tools first on its `PATH`: found there, and for what it runs.
pub fn command(program: impl AsRef<OsStr>) -> Command {
    let mut search: Vec<PathBuf> = Some(programs())
        .filter(|p| p.is_dir())
        .into_iter()
        .collect();
    search.extend(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    ));
    let path: OsString = std::env::join_paths(search).unwrap_or_default();
    let mut command = Command::new(program);
    command.env("PATH", path);
    command
}
