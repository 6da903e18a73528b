//! The README's daemon example runs as written up to its configuration
//! check: its commands make the token files and the configuration file, and
//! `hypervisor check-config` accepts the file without a warning. Its folder,
//! `/etc/gpushare`, becomes a temporary one; the daemon's start and the
//! program after it (a fixed port, the user's `train.py`) are left out.

use std::path::PathBuf;
use std::process::Command;

const README: &str = include_str!("../../../README.md");
const CONFIG_DIR: &str = "/etc/gpushare";

/// The README's `sh` block that writes `hypervisor.toml`, up to and with
/// its `hypervisor check-config` line.
fn example_to_check() -> String {
    let block = README
        .split("```sh\n")
        .skip(1)
        .filter_map(|rest| Some(rest.split_once("```")?.0))
        .find(|block| block.contains("cat > hypervisor.toml"))
        .expect("the README's daemon example");
    let mut lines = Vec::new();
    for line in block.lines() {
        lines.push(line);
        if line.starts_with("hypervisor check-config") {
            return lines.join("\n") + "\n";
        }
    }
    panic!("no `hypervisor check-config` line in the example:\n{block}");
}

/// A folder of this test's own, removed on drop.
struct Folder(PathBuf);

impl Drop for Folder {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn the_daemon_example_passes_its_configuration_check() {
    let folder = Folder(std::env::temp_dir().join(format!("readme-config-{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&folder.0);
    let dir = folder.0.join("gpushare");
    let script = example_to_check().replace(CONFIG_DIR, dir.to_str().expect("a UTF-8 path"));
    assert!(!script.contains(CONFIG_DIR), "{script}");
    let binary = system_tests::artifacts::hypervisor();
    let path = format!(
        "{}:{}",
        binary.parent().expect("the binary's folder").display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new("bash")
        .args(["-euo", "pipefail", "-c", &script])
        .env("PATH", path)
        .current_dir(std::env::temp_dir())
        .output()
        .expect("bash runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr),
    );
    assert!(
        output.status.success(),
        "{script}\nstdout:\n{stdout}\nstderr:\n{stderr}"
    );
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(
        lines,
        [
            "listen 127.0.0.1:7070",
            "admin API on",
            "pod a (1 GPUs)",
            "  index 0: memory 4294967296 bytes, weight 1, cap 30%, share -, policy fixed",
        ],
        "{stderr}"
    );
}
