//! Running the double's probe programs with a clean environment.

#![allow(dead_code)]

use std::process::{Command, Output};

use gpushare_examples::{DEFAULT_CONTEXT_BYTES, command, program};

pub(crate) mod checkpoint_api;
pub(crate) mod in_process;
pub(crate) mod interactive;

pub(crate) const KIB: u64 = 1 << 10;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const GIB: u64 = 1 << 30;
/// What a context takes on the simulated GPU, by default.
pub(crate) const CTX: u64 = DEFAULT_CONTEXT_BYTES;
/// A millisecond in ns.
pub(crate) const MS: u64 = 1_000_000;

pub(crate) const CUDA_SUCCESS: std::ffi::c_int = 0;
pub(crate) const CUDA_ERROR_NOT_FOUND: std::ffi::c_int = 500;

/// The three ways a program reaches the driver.
pub(crate) const VARIANTS: &[(&str, &[&str])] = &[
    ("cudaprobe", &["--via", "dlsym"]),
    ("cudaprobe", &["--via", "getproc"]),
    ("cudaprobe_linked", &[]),
];

/// What a test's child must not inherit: the preload and the double's knobs.
const INHERITED: [&str; 7] = [
    "LD_PRELOAD",
    "GPUSHARE_DOUBLE_DEVICES",
    "GPUSHARE_DOUBLE_TOTAL",
    "GPUSHARE_DOUBLE_CONTEXT_BYTES",
    "GPUSHARE_DOUBLE_KERNEL_NS",
    "GPUSHARE_DOUBLE_QUEUE_DEPTH",
    gpushare_examples::NODE_FILE_VAR,
];

/// Marks the child a test binary starts of itself.
const CHILD: &str = "GPUSHARE_EXAMPLES_TEST_CHILD";

/// Runs the test `name` again in a fresh process (the double's state, the
/// simulated GPU included, is per process) with only `env` of the double's
/// knobs; returns true in that child, which then does the work. `name` is
/// the test's name in the calling file, whose module the caller's location
/// gives.
#[track_caller]
pub(crate) fn in_fresh_process(name: &str, env: &[(&str, &str)]) -> bool {
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let caller = std::path::Path::new(std::panic::Location::caller().file());
    let module = caller
        .file_stem()
        .and_then(|stem| stem.to_str())
        .expect("the caller's file");
    let test = format!("{module}::{name}");
    let mut cmd = Command::new(std::env::current_exe().expect("test executable"));
    cmd.args(["--exact", &test, "--test-threads=1", "--nocapture"])
        .env(CHILD, "1");
    for var in INHERITED {
        cmd.env_remove(var);
    }
    let output = cmd
        .envs(env.iter().copied())
        .output()
        .expect("run the test binary again");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("1 passed"), "{stdout}");
    false
}

/// Runs a probe with only the given double environment (nothing inherited
/// from GPUSHARE_DOUBLE_* or LD_PRELOAD). The linked variant runs without
/// LD_LIBRARY_PATH, to show its rpath finds the double.
pub(crate) fn run(name: &str, options: &[&str], script: &str, env: &[(&str, &str)]) -> Output {
    probe_command(name, options, script, env)
        .output()
        .expect("run the probe")
}

/// The command [`run`] runs, for a test that talks to the probe.
pub(crate) fn probe_command(
    name: &str,
    options: &[&str],
    script: &str,
    env: &[(&str, &str)],
) -> Command {
    let mut cmd = if name == "cudaprobe_linked" {
        let mut cmd = Command::new(program(name));
        cmd.env_remove("LD_LIBRARY_PATH");
        cmd
    } else {
        command(name)
    };
    for var in INHERITED {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied())
        .args(options)
        .args(script.split_whitespace());
    cmd
}

/// Asserts that the probe rejects `script` before doing anything: exit 2,
/// nothing on stdout, one `cudaprobe: ` line on stderr.
pub(crate) fn assert_malformed(script: &str) {
    let output = run("cudaprobe", &[], script, &[]);
    assert_eq!(output.status.code(), Some(2), "{script}");
    assert!(output.stdout.is_empty(), "{script}");
    assert!(
        String::from_utf8_lossy(&output.stderr).starts_with("cudaprobe: "),
        "{script}"
    );
}

/// The stdout lines of a probe that must succeed.
pub(crate) fn lines(
    name: &str,
    options: &[&str],
    script: &str,
    env: &[(&str, &str)],
) -> Vec<String> {
    let output = run(name, options, script, env);
    assert!(
        output.status.success(),
        "{name} {options:?} {script}: {:?}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}
