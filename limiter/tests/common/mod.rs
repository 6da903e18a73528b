//! Running the double's probe programs with the built limiter preloaded.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

pub const MIB: u64 = 1 << 20;
pub const GIB: u64 = 1 << 30;
/// What the double's first context charges as the driver's own memory.
pub const CONTEXT_BYTES: u64 = 300 * MIB;

/// The limiter built for this test run (cargo builds the cdylib into `deps/`).
pub fn limiter() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps directory");
    let library = deps.join("libcuda_limiter.so");
    assert!(library.exists(), "{} not built", library.display());
    library
}

/// A pod identity of its own for each test; its ledger, limits and test node
/// table are removed after, whatever the test's outcome.
pub struct Pod(pub String);

impl Pod {
    pub fn new(test: &str) -> Self {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let id = format!(
            "t{}-{}-{}",
            std::process::id(),
            test,
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        Self(id)
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        for prefix in [
            "gpushare-pod-",
            "gpushare-limits-",
            "gpushare-node-test-",
            "gpushare-priority-test-",
        ] {
            let _ignored = std::fs::remove_file(format!("/dev/shm/{prefix}{}", self.0));
        }
    }
}

/// `program` (a probe of the double) under the limiter, for `pod`, with the
/// fake GPU's size and extra environment.
pub fn probe(program: &str, pod: &Pod, env: &[(&str, &str)], args: &[&str]) -> Command {
    let mut command = gpushare_examples::command(program);
    command
        .env("LD_PRELOAD", limiter())
        .env("CUDA_LIMITER_POD", &pod.0)
        .env("GPUSHARE_DOUBLE_TOTAL", "16g")
        .env_remove("CUDA_LIMITER_LOG")
        .args(args);
    for (key, value) in env {
        command.env(key, value);
    }
    command
}

/// Runs and returns stdout lines, failing the test with stderr on a non-zero exit.
pub fn run(mut command: Command) -> Vec<String> {
    let output = command.output().expect("spawn probe");
    check(&output);
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

pub fn check(output: &Output) {
    assert!(
        output.status.success(),
        "probe failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// `info RESULT free=F total=T` for the given numbers.
pub fn info(result: u32, free: u64, total: u64) -> String {
    format!("info {result} free={free} total={total}")
}

/// The `CUresult` of an `alloc`/`free`/`ptr` line (`... -> RESULT ...`).
pub fn result_of(line: &str) -> u32 {
    let after = line
        .split("-> ")
        .nth(1)
        .unwrap_or_else(|| panic!("no result in {line:?}"));
    after
        .split_whitespace()
        .next()
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad result in {line:?}"))
}

/// The probe programs and how each reaches the driver: linked, `dlsym`,
/// `cuGetProcAddress`.
pub const VIAS: [(&str, &[&str]); 3] = [
    ("cudaprobe_linked", &[]),
    ("cudaprobe", &["--via", "dlsym"]),
    ("cudaprobe", &["--via", "getproc"]),
];

/// Timed tests of one binary take turns: each needs the CPUs of a small CI
/// machine to itself to keep its timing.
pub fn serial() -> std::sync::MutexGuard<'static, ()> {
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}
