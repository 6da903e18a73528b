//! The ledger across real processes: children are this test binary re-executed
//! with `--exact ledger_processes::child_role`, the role chosen by an environment variable. A
//! child reports on stdout (`LEDGER-CHILD ...`) and holds its ledger until its
//! stdin closes.

use std::ffi::CString;
use std::io::{BufRead, BufReader, Lines, Read, Write};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use gpushare_utils::ledger::{LedgerError, MAGIC, PodLedger};

const ROLE: &str = "GPUSHARE_LEDGER_TEST_ROLE";
const REGION: &str = "GPUSHARE_LEDGER_TEST_REGION";
const BYTES: &str = "GPUSHARE_LEDGER_TEST_BYTES";
const GO_AT_MS: &str = "GPUSHARE_LEDGER_TEST_GO_AT_MS";
const PREFIX: &str = "LEDGER-CHILD ";
const DEV: usize = 0;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Entry point of every child; does nothing in the parent's own run.
#[test]
fn child_role() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let name = std::env::var(REGION).expect("region name");
    let bytes: u64 = std::env::var(BYTES).map_or(0, |b| b.parse().expect("byte count"));
    if let Ok(go_at) = std::env::var(GO_AT_MS) {
        let go_at: u128 = go_at.parse().expect("start time");
        while unix_ms() < go_at {
            std::hint::spin_loop();
        }
    }
    let ledger = match PodLedger::open_named(&name) {
        Ok(ledger) => ledger,
        Err(err) => {
            report(&format!("error {err}"));
            return;
        }
    };
    match role.as_str() {
        "reserve" => match ledger.try_reserve(DEV, bytes) {
            Ok(()) => report("ok"),
            Err(LedgerError::OverQuota { used, .. }) => report(&format!("over {used}")),
            Err(err) => report(&format!("error {err}")),
        },
        "race" => {
            let me = std::process::id() as i32;
            let slot = ledger
                .region()
                .processes
                .iter()
                .position(|slot| slot.pid.load(Ordering::Acquire) == me);
            let magic = ledger.region().header.magic.load(Ordering::Acquire) == MAGIC;
            match (ledger.try_reserve(DEV, bytes), slot) {
                (Ok(()), Some(slot)) if magic => report(&format!("ok {slot}")),
                (result, slot) => report(&format!("error {result:?} {slot:?} {magic}")),
            }
        }
        other => report(&format!("error unknown role {other}")),
    }
    // Hold the ledger until the parent closes our stdin.
    let mut sink = Vec::new();
    let _read = std::io::stdin().read_to_end(&mut sink);
    drop(ledger);
}

fn report(line: &str) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{PREFIX}{line}").expect("stdout");
    out.flush().expect("stdout");
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_millis()
}

/// A unique region name, unlinked when dropped.
struct TestRegion(String);

impl TestRegion {
    fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        TestRegion(format!("gpushare-test-procs-{}-{n}", std::process::id()))
    }
    fn open(&self) -> PodLedger {
        PodLedger::open_named(&self.0).expect("open ledger")
    }
}

impl Drop for TestRegion {
    fn drop(&mut self) {
        let name = CString::new(self.0.clone()).expect("name without NUL");
        // SAFETY: `name` is a valid NUL-terminated string.
        unsafe { libc::shm_unlink(name.as_ptr()) };
    }
}

/// A child process running `child_role`; killed and reaped if still running
/// when dropped.
struct ChildProc {
    child: Child,
    lines: Lines<BufReader<ChildStdout>>,
}

impl ChildProc {
    fn spawn(role: &str, region: &TestRegion, bytes: u64, go_at: Option<u128>) -> Self {
        let exe = std::env::current_exe().expect("test binary path");
        let mut command = Command::new(exe);
        command
            .args([
                "--exact",
                "ledger_processes::child_role",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE, role)
            .env(REGION, &region.0)
            .env(BYTES, bytes.to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(go_at) = go_at {
            command.env(GO_AT_MS, go_at.to_string());
        }
        let mut child = command.spawn().expect("spawn child");
        let stdout = child.stdout.take().expect("child stdout");
        ChildProc {
            child,
            lines: BufReader::new(stdout).lines(),
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// The child's next report.
    fn report(&mut self) -> String {
        for line in self.lines.by_ref() {
            let line = line.expect("child stdout");
            // libtest may have written "test child_role ... " on the same line.
            if let Some((_, report)) = line.split_once(PREFIX) {
                return report.to_owned();
            }
        }
        panic!("child exited without reporting");
    }

    /// Closes stdin so the child drops its ledger and exits; waits for it.
    fn finish(mut self) {
        drop(self.child.stdin.take());
        let status = self.child.wait().expect("wait child");
        assert!(status.success(), "child failed: {status}");
    }

    /// SIGKILL without reaping: the child stays a zombie until waited for.
    fn sigkill(&mut self) {
        self.child.kill().expect("SIGKILL child");
    }

    fn reap(&mut self) {
        let _status = self.child.wait().expect("wait child");
    }
}

impl Drop for ChildProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _killed = self.child.kill();
            let _status = self.child.wait();
        }
    }
}

fn slot_of(ledger: &PodLedger, pid: i32) -> Option<usize> {
    ledger
        .region()
        .processes
        .iter()
        .position(|slot| slot.pid.load(Ordering::Acquire) == pid)
}

#[test]
fn two_processes_share_one_quota() {
    let region = TestRegion::new();
    let parent = region.open();
    parent.set_quota(DEV, 4 * GIB).unwrap();

    let mut child = ChildProc::spawn("reserve", &region, 3 * GIB, None);
    assert_eq!(child.report(), "ok");
    assert_eq!(parent.usage(DEV).unwrap().used, 3 * GIB);

    match parent.try_reserve(DEV, 2 * GIB) {
        Err(LedgerError::OverQuota {
            quota,
            used,
            requested,
            ..
        }) => assert_eq!((quota, used, requested), (4 * GIB, 3 * GIB, 2 * GIB)),
        other => panic!("expected OverQuota, got {other:?}"),
    }
    parent.try_reserve(DEV, GIB).unwrap();
    assert!(parent.try_reserve(DEV, 1).is_err());

    // A third process finds the pod full too.
    let mut third = ChildProc::spawn("reserve", &region, MIB, None);
    assert_eq!(third.report(), format!("over {}", 4 * GIB));
    third.finish();

    child.finish();
    assert_eq!(parent.usage(DEV).unwrap().used, GIB);
    parent.try_reserve(DEV, 3 * GIB).unwrap();
}

#[test]
fn sigkilled_child_is_reclaimed_on_next_reserve() {
    let region = TestRegion::new();
    let parent = region.open();
    parent.set_quota(DEV, 4 * GIB).unwrap();
    let mut child = ChildProc::spawn("reserve", &region, 3 * GIB, None);
    assert_eq!(child.report(), "ok");
    assert!(parent.try_reserve(DEV, 2 * GIB).is_err());

    // A reservation that does not fit scans for dead processes at once and
    // never waits, so its success is the reclaim.
    child.sigkill();
    child.reap();
    parent.try_reserve(DEV, 2 * GIB).unwrap();
    assert_eq!(parent.usage(DEV).unwrap().used, 2 * GIB);
    assert_eq!(slot_of(&parent, child.pid()), None);
}

#[test]
fn sigkilled_zombie_is_reclaimed_by_periodic_scan() {
    let region = TestRegion::new();
    let parent = region.open();
    let mut child = ChildProc::spawn("reserve", &region, 3 * GIB, None);
    assert_eq!(child.report(), "ok");

    // Not reaped: the child lingers as a zombie. No quota: no over-quota scan,
    // only the periodic one inside try_reserve.
    // The scan is due every 250 ms; without it the bytes are never given
    // back. Five seconds is twenty intervals: room for a loaded machine.
    child.sigkill();
    let killed = Instant::now();
    while parent.usage(DEV).unwrap().used != 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "dead child's bytes still counted after 5 s"
        );
        parent.try_reserve(DEV, 1).unwrap();
        assert_eq!(parent.release(DEV, 1).unwrap(), 1);
        std::thread::sleep(Duration::from_millis(10));
    }
    child.reap();
}

#[test]
fn stale_slot_of_a_reused_pid_is_reclaimed_once() {
    let region = TestRegion::new();
    let parent = region.open();
    parent.try_reserve(DEV, 512 * MIB).unwrap();
    let mut child = ChildProc::spawn("reserve", &region, GIB, None);
    assert_eq!(child.report(), "ok");

    // Alive with its own start time: kept.
    assert_eq!(parent.reclaim_dead(), 0);
    let slot = slot_of(&parent, child.pid()).expect("child's slot");

    // Pretend the slot's process died and its pid went to the process now
    // running: the start time no longer matches.
    let start = &parent.region().processes[slot].start_time;
    start.store(start.load(Ordering::Acquire) + 1, Ordering::Release);
    assert_eq!(parent.reclaim_dead(), GIB);
    assert_eq!(parent.usage(DEV).unwrap().used, 512 * MIB);
    assert_eq!(
        parent.region().processes[slot].pid.load(Ordering::Acquire),
        0
    );

    // The child exits normally; its slot is gone, so it gives nothing back twice.
    child.finish();
    assert_eq!(parent.usage(DEV).unwrap().used, 512 * MIB);
}

#[test]
fn eight_processes_racing_to_create_see_one_region() {
    const CHILDREN: usize = 8;
    let region = TestRegion::new();
    let go_at = unix_ms() + 500;
    let mut children: Vec<_> = (0..CHILDREN)
        .map(|_| ChildProc::spawn("race", &region, MIB, Some(go_at)))
        .collect();
    let mut slots: Vec<usize> = children
        .iter_mut()
        .map(|child| {
            let report = child.report();
            let slot = report
                .strip_prefix("ok ")
                .unwrap_or_else(|| panic!("child failed: {report}"));
            slot.parse().expect("slot index")
        })
        .collect();
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), CHILDREN, "children shared a slot");

    let parent = region.open();
    assert_eq!(parent.usage(DEV).unwrap().used, CHILDREN as u64 * MIB);
    for child in &children {
        assert!(slot_of(&parent, child.pid()).is_some());
    }
    for child in children {
        child.finish();
    }
    assert_eq!(parent.usage(DEV).unwrap().used, 0);
}

#[test]
fn forked_child_gets_a_fresh_slot() {
    let region = TestRegion::new();
    let ledger = region.open();
    ledger.try_reserve(DEV, 100).unwrap();

    // SAFETY: the child only touches the ledger (atomics, /proc reads) and
    // leaves with _exit, running no destructor and no test-harness code.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        let code = (|| {
            if !matches!(ledger.process_usage(DEV), Ok(0)) {
                return 1;
            }
            // The parent's bytes are not the child's to give back.
            if !matches!(ledger.release(DEV, 100), Ok(0)) {
                return 2;
            }
            if !matches!(ledger.usage(DEV), Ok(usage) if usage.used == 100) {
                return 3;
            }
            if ledger.try_reserve(DEV, 10).is_err() {
                return 4;
            }
            if !matches!(ledger.process_usage(DEV), Ok(10)) {
                return 5;
            }
            if !matches!(ledger.usage(DEV), Ok(usage) if usage.used == 110) {
                return 6;
            }
            // SAFETY: getpid has no preconditions.
            if slot_of(&ledger, unsafe { libc::getpid() }).is_none() {
                return 7;
            }
            0
        })();
        // SAFETY: ends the forked child at once, as fork requires in a
        // multi-threaded parent.
        unsafe { libc::_exit(code) };
    }
    let mut status = 0;
    // SAFETY: `pid` is our child; `status` is a valid out-pointer.
    let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
    assert_eq!(waited, pid);
    assert!(
        libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
        "forked child failed with status {status:#x}"
    );
    assert_eq!(ledger.process_usage(DEV).unwrap(), 100);
    // The child left without dropping its ledger: its 10 bytes come back by reclaim.
    assert_eq!(ledger.usage(DEV).unwrap().used, 110);
    assert_eq!(ledger.reclaim_dead(), 10);
    assert_eq!(ledger.usage(DEV).unwrap().used, 100);
    assert_eq!(ledger.release(DEV, 100).unwrap(), 100);
}
