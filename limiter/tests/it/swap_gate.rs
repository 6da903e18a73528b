//! The residency gate: while its pod's published limits say the pod is not
//! on its GPUs, a process's calls that need them wait in the limiter, before
//! the driver, and go on once the limits say it is back. No hypervisor here
//! (nobody to ask for the pod back): the test moves the pod's residency as
//! the hypervisor does. Asking the daemon, and making room, are the system
//! tests'.

use crate::common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use common::{GIB, Pod, probe, result_of};
use gpushare_utils::ledger::PodLedger;
use gpushare_utils::limits::{PodLimits, Residency};
use gpushare_utils::shm::Creation;

/// How long a call is watched to stay held.
const HELD: Duration = Duration::from_millis(200);
/// How long a call may take to go on once the pod is back.
const BACK_WITHIN: Duration = Duration::from_secs(5);

/// The pod's limits as the hypervisor publishes them: `quota` on the
/// double's GPU 0, writable here.
fn publish(pod: &Pod, quota: u64) -> PodLimits {
    let limits = PodLimits::create_or_adopt(&pod.0, &Creation::default()).expect("limits");
    limits
        .set(&gpushare_examples::uuid(0), quota)
        .expect("quota");
    limits.publish();
    limits
}

/// A probe of `pod` running `args` under the pod's published limits (a
/// local limit turns the limiter on; published limits replace it), its
/// lines read as they come.
struct Running {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl Running {
    fn start(pod: &Pod, args: &[&str]) -> Self {
        // SAFETY: geteuid has no preconditions.
        let uid = unsafe { libc::geteuid() }.to_string();
        let env = [
            ("CUDA_DEVICE_MEMORY_LIMIT", "8g"),
            ("CUDA_LIMITER_REGION_OWNER", uid.as_str()),
            ("CUDA_LIMITER_LOG", "info"),
        ];
        let mut child = probe("cudaprobe", pod, &env, args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn probe");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = child.stdout.take().expect("stdout");
        let (sender, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if sender.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            stdin,
            lines,
        }
    }

    fn next(&self, within: Duration) -> String {
        self.lines.recv_timeout(within).expect("a line in time")
    }

    /// Lets a `wait` command go on.
    fn resume(&mut self) {
        writeln!(self.stdin).expect("resume");
        assert_eq!(self.next(BACK_WITHIN), "resumed");
    }

    /// Asserts no line comes for `held`.
    fn assert_held(&self, held: Duration, what: &str) {
        match self.lines.recv_timeout(held) {
            Err(RecvTimeoutError::Timeout) => {}
            other => panic!("{what} was not held: {other:?}"),
        }
    }

    /// The probe's exit, and its stderr.
    fn finish(self) -> String {
        drop(self.stdin);
        let output = self.child.wait_with_output().expect("wait");
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        assert!(output.status.success(), "{stderr}");
        stderr
    }
}

/// The result of a probe line: `… -> RESULT …`, or `sync RESULT` and the
/// stream commands' `COMMAND RESULT`.
fn code(line: &str) -> u32 {
    if line.contains("-> ") {
        return result_of(line);
    }
    let last = line.split_whitespace().last();
    last.and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("bad result in {line:?}"))
}

/// A figure of the exit summary's `swap summary:` line.
fn summary_figure(stderr: &str, key: &str) -> u64 {
    let line = stderr
        .lines()
        .find(|line| line.contains("swap summary:"))
        .unwrap_or_else(|| panic!("no swap summary in {stderr}"));
    line.split_whitespace()
        .find_map(|part| part.strip_prefix(key)?.strip_prefix('='))
        .and_then(|value| value.parse().ok())
        .unwrap_or_else(|| panic!("no {key} in {line}"))
}

#[test]
fn every_family_waits_while_the_pod_is_away_and_goes_on_when_it_is_back() {
    let pod = Pod::new("swapgate");
    let limits = publish(&pod, 4 * GIB);
    // Each call after a `wait` runs while the pod is away; the first copy
    // makes the copy and set commands' scratch memory before then.
    let calls: [&[&str]; 10] = [
        &["copy", "h2d", "1m"],
        &["copy_async", "d2h", "1m"],
        &["copy", "d2d", "1m"],
        &["set", "1m"],
        &["set_async", "1m"],
        &["stream_query"],
        &["stream_sync"],
        &["sync"],
        &["alloc", "mem", "1m"],
        &["spin", "kernel", "10", "1"],
    ];
    let mut args = vec!["copy", "h2d", "1m"];
    for call in &calls {
        args.push("wait");
        args.extend_from_slice(call);
    }
    let mut probe = Running::start(&pod, &args);
    assert_eq!(result_of(&probe.next(BACK_WITHIN)), 0);
    let mut away = Duration::ZERO;
    for (call, residency) in calls.iter().zip(
        [
            Residency::SwappingOut,
            Residency::Swapped,
            Residency::SwappingIn,
        ]
        .into_iter()
        .cycle(),
    ) {
        assert_eq!(probe.next(BACK_WITHIN), "ready");
        limits.set_residency(residency);
        let left = Instant::now();
        probe.resume();
        probe.assert_held(HELD, &call.join(" "));
        limits.set_residency(Residency::Resident);
        let line = probe.next(BACK_WITHIN);
        away += left.elapsed();
        assert!(line.starts_with(&call.join(" ")), "{line}");
        assert_eq!(code(&line), 0, "{line}");
    }
    let stderr = probe.finish();
    assert_eq!(summary_figure(&stderr, "waits"), calls.len() as u64);
    let waited = summary_figure(&stderr, "waited_ns");
    assert!(
        waited >= HELD.as_nanos() as u64 * calls.len() as u64 && waited <= away.as_nanos() as u64,
        "waited {waited} ns, away {away:?}"
    );
    assert_eq!(
        summary_figure(&stderr, "swap_in_requests"),
        0,
        "no hypervisor to ask"
    );
    let stamp = PodLedger::open(&pod.0).expect("ledger").last_call_ms();
    assert!(stamp > 0, "the pod's calls are stamped");
}

#[test]
fn a_resident_pod_passes_without_a_summary() {
    let pod = Pod::new("swapnone");
    let _limits = publish(&pod, 4 * GIB);
    let probe = Running::start(
        &pod,
        &[
            "copy",
            "h2d",
            "1m",
            "set",
            "1m",
            "stream_sync",
            "spin",
            "kernel",
            "10",
            "1",
        ],
    );
    for _ in 0..4 {
        assert_eq!(code(&probe.next(BACK_WITHIN)), 0);
    }
    let stderr = probe.finish();
    assert!(!stderr.contains("swap summary"), "{stderr}");
}

#[test]
fn an_allocation_the_gpu_cannot_hold_fails_as_the_driver_said_and_gives_its_reservation_back() {
    // Within the quota, past what the double's 16 GiB GPU has: no hypervisor
    // to make room, so the driver's out of memory stands, and the 18 GiB
    // reserved for it are given back (10 GiB more would not fit otherwise).
    let pod = Pod::new("noroom");
    let _limits = publish(&pod, 20 * GIB);
    let probe = Running::start(&pod, &["alloc", "mem", "18g", "alloc", "mem", "10g"]);
    assert_eq!(code(&probe.next(BACK_WITHIN)), 2, "out of memory");
    assert_eq!(
        code(&probe.next(BACK_WITHIN)),
        0,
        "the quota holds the 10 GiB"
    );
    probe.finish();
}
