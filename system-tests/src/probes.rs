//! The driver double's probe programs (`gpushare_examples`) run with the
//! built limiter preloaded, as a pod's processes, and their output lines
//! read (format in the double's `programs/cudaprobe.c`), with the one
//! tolerance the timed tests share ([`assert_share_of`]).

use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, PoisonError};

use crate::artifacts::limiter;
use crate::pod::{Pod, node_tables};

/// A mebibyte.
pub const MIB: u64 = 1 << 20;
/// A gibibyte.
pub const GIB: u64 = 1 << 30;
/// What the double's first context charges as the driver's own memory.
pub const CONTEXT_BYTES: u64 = gpushare_examples::DEFAULT_CONTEXT_BYTES;

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

/// Points `command`'s limiter at the node tables of [`node_tables`].
pub fn use_node_tables(command: &mut Command, pod: &Pod) {
    let tables = node_tables(pod);
    command
        .env("GPUSHARE_NODE_REGION", tables.activity)
        .env("GPUSHARE_PRIORITY_REGION", tables.priority);
}

/// `command` run as `uid` (its group too, no supplementary groups), with
/// the same environment.
pub fn as_uid(command: &Command, uid: u32) -> Command {
    let mut wrapped = Command::new("setpriv");
    wrapped
        .arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .arg("--clear-groups")
        .arg("--")
        .arg(command.get_program())
        .args(command.get_args());
    for (key, value) in command.get_envs() {
        match value {
            Some(value) => wrapped.env(key, value),
            None => wrapped.env_remove(key),
        };
    }
    wrapped
}

/// Runs and returns stdout lines, failing the test with stderr on a non-zero exit.
pub fn run(mut command: Command) -> Vec<String> {
    let output = command.output().expect("spawn probe");
    check(&output);
    stdout_lines(&output)
}

/// A finished probe's stdout, a string a line.
pub fn stdout_lines(output: &Output) -> Vec<String> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(str::to_owned)
        .collect()
}

/// Fails the test, with the probe's output, unless it exited successfully.
pub fn check(output: &Output) {
    assert!(
        output.status.success(),
        "probe failed: {:?}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// Timed tests of one binary take turns: each needs the CPUs of a small CI
/// machine to itself to keep its timing.
pub fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
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

/// `key=value` of a probe line as a number.
pub fn number(line: &str, key: &str) -> i64 {
    gpushare_examples::probe_field(line, key)
        .and_then(|value| i64::try_from(value).ok())
        .unwrap_or_else(|| panic!("no {key} in {line:?}"))
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
