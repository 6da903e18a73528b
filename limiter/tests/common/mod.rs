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

/// `key=value` of a probe line as a number.
pub fn number(line: &str, key: &str) -> i64 {
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
}

/// How much of a `run`/`spin` line's wall time its launching thread spent
/// runnable but waiting for a CPU, in per mille.
pub fn delay_pm(line: &str) -> i64 {
    let wall = number(line, "wall_ns").max(1);
    number(line, "delay_ns") * 1000 / wall
}

/// Asserts that a `run`/`spin` line's busy share is `want` per mille within
/// `tolerance`, less the launching thread's run delay (see [`assert_share_of`]).
pub fn assert_share(line: &str, want: i64, tolerance: i64) {
    assert_share_of(
        number(line, "share_pm"),
        delay_pm(line),
        want,
        tolerance,
        line,
    );
}

/// Asserts that a busy share of `got` per mille is `want` within `tolerance`
/// above it, and within `tolerance` plus `delay` (the launching thread's run
/// delay, per mille of the run) below it. A limit caps the share however the
/// machine is loaded; it cannot run a thread the kernel does not schedule,
/// and a thread that waits for a CPU for some time idles the GPU for at most
/// that time. So on a busy CI machine the share can only fall short, by no
/// more than the delay the probe measured: a shortfall beyond it, or any
/// excess, is the limiter's.
pub fn assert_share_of(got: i64, delay: i64, want: i64, tolerance: i64, context: &str) {
    assert!(
        got <= want + tolerance && got >= want - tolerance - delay,
        "share {got}‰, want {want}‰ ± {tolerance}‰ (less the {delay}‰ the thread waited for a CPU): {context}"
    );
}

/// The `key=value` of the first line starting with `prefix` that has `key`.
pub fn line_field<'a>(lines: &'a [String], prefix: &str, key: &str) -> &'a str {
    lines
        .iter()
        .filter(|line| line.starts_with(prefix))
        .find_map(|line| {
            line.split_whitespace()
                .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        })
        .unwrap_or_else(|| panic!("no {prefix}… {key}= in {lines:?}"))
}

/// The N of each `COMMAND ns=N` line (`clock`, `settled`), in order.
pub fn times(lines: &[String], command: &str) -> Vec<u64> {
    lines
        .iter()
        .filter_map(|line| line.strip_prefix(command)?.strip_prefix(" ns="))
        .map(|n| n.parse().expect("ns"))
        .collect()
}

/// The idle stretches of an `idle STEP at=a-b,…` line.
pub fn idle_spans(lines: &[String]) -> Vec<(u64, u64)> {
    line_field(lines, "idle ", "at")
        .split(',')
        .filter(|span| !span.is_empty())
        .map(|span| {
            let (a, b) = span.split_once('-').expect("a-b");
            (a.parse().expect("a"), b.parse().expect("b"))
        })
        .collect()
}

/// The probe as one pod of priority class `class`, on its own node and
/// priority tables, its output piped.
pub fn class_probe(pod: &Pod, node: &str, priority: &str, class: &str, args: &[&str]) -> Command {
    let mut command = probe(
        "cudaprobe",
        pod,
        &[
            ("CUDA_LIMITER_CLASS", class),
            ("GPUSHARE_NODE_REGION", node),
            ("GPUSHARE_PRIORITY_REGION", priority),
        ],
        args,
    );
    command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    command
}

/// A finished child's stdout lines, failing the test on a non-zero exit.
pub fn output_lines(child: std::process::Child) -> Vec<String> {
    let output = child.wait_with_output().expect("probe");
    check(&output);
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}
