//! Tests of the ledger protocol.

use super::layout::{STATE_INITIALIZING, STATE_READY};
use super::*;
use crate::process::{own_pid_ns, read_proc_stat};
use crate::shm::{self, Creation, ShmError, Trust};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

const DEV: usize = 0;
/// Far above any pid_max (2^22): never a live process.
const DEAD_PID: i32 = 0x7fff_0000;

/// A unique region name, unlinked when dropped.
struct TestRegion(String);

impl TestRegion {
    fn new() -> Self {
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        TestRegion(format!("gpushare-test-ledger-{}-{n}", std::process::id()))
    }
    fn open(&self) -> PodLedger {
        PodLedger::open_named(&self.0).expect("open ledger")
    }
    /// A raw region of `size` bytes under this name, to forge headers.
    fn raw(&self, size: usize) -> shm::Mapping {
        shm::create(&self.0, size, &Creation::default())
            .expect("create raw region")
            .expect("a fresh name")
    }
}

impl Drop for TestRegion {
    fn drop(&mut self) {
        let name = std::ffi::CString::new(self.0.clone()).expect("name without NUL");
        // SAFETY: `name` is a valid NUL-terminated string.
        unsafe { libc::shm_unlink(name.as_ptr()) };
    }
}

/// Forges a slot for a process that is not us.
fn forge_slot(ledger: &PodLedger, pid: i32, start_time: u64, ns: u64, dev: usize, bytes: u64) {
    let region = ledger.region();
    let slot = region
        .processes
        .iter()
        .find(|slot| {
            slot.pid
                .compare_exchange(0, pid, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        })
        .expect("a free slot");
    slot.start_time.store(start_time, Ordering::Release);
    slot.pid_ns.store(ns, Ordering::Release);
    slot.used[dev].store(bytes, Ordering::Release);
    region.devices[dev].used.fetch_add(bytes, Ordering::AcqRel);
}

fn parent() -> (i32, u64) {
    // SAFETY: getppid has no preconditions.
    let ppid = unsafe { libc::getppid() };
    let start = read_proc_stat(&format!("/proc/{ppid}/stat"))
        .expect("parent stat")
        .start_time;
    (ppid, start)
}

#[test]
fn reserve_and_release_add_up() {
    let region = TestRegion::new();
    let ledger = region.open();
    ledger.set_quota(DEV, 100).unwrap();
    assert_eq!(ledger.quota(DEV).unwrap(), 100);
    ledger.try_reserve(DEV, 60).unwrap();
    match ledger.try_reserve(DEV, 50) {
        Err(LedgerError::OverQuota {
            dev,
            quota,
            used,
            requested,
        }) => {
            assert_eq!((dev, quota, used, requested), (DEV, 100, 60, 50));
        }
        other => panic!("expected OverQuota, got {other:?}"),
    }
    ledger.try_reserve(DEV, 40).unwrap();
    assert_eq!(
        ledger.usage(DEV).unwrap(),
        DeviceUsage {
            quota: 100,
            used: 100,
            peak: 100
        }
    );
    assert_eq!(ledger.release(DEV, 30).unwrap(), 30);
    assert_eq!(ledger.usage(DEV).unwrap().used, 70);
    assert_eq!(ledger.process_usage(DEV).unwrap(), 70);
    // Other devices are untouched.
    assert_eq!(
        ledger.usage(1).unwrap(),
        DeviceUsage {
            quota: 0,
            used: 0,
            peak: 0
        }
    );
    ledger.try_reserve(DEV, 0).unwrap();
    assert_eq!(ledger.release(DEV, 0).unwrap(), 0);
}

#[test]
fn zero_quota_is_unlimited_until_overflow() {
    let region = TestRegion::new();
    let ledger = region.open();
    let half = u64::MAX / 2;
    ledger.try_reserve(DEV, half).unwrap();
    ledger.try_reserve(DEV, half).unwrap();
    assert!(matches!(
        ledger.try_reserve(DEV, 2),
        Err(LedgerError::OverQuota { quota: 0, .. })
    ));
    assert_eq!(ledger.usage(DEV).unwrap().used, half * 2);
}

#[test]
fn release_saturates_and_never_takes_others_bytes() {
    let region = TestRegion::new();
    let a = region.open();
    let b = region.open();
    a.try_reserve(DEV, 50).unwrap();
    b.try_reserve(DEV, 10).unwrap();
    assert_eq!(b.release(DEV, 25).unwrap(), 10);
    assert_eq!(b.release(DEV, 5).unwrap(), 0);
    assert_eq!(b.process_usage(DEV).unwrap(), 0);
    assert_eq!(a.process_usage(DEV).unwrap(), 50);
    assert_eq!(a.usage(DEV).unwrap().used, 50);
}

#[test]
fn overhead_is_set_not_added_and_may_exceed_quota() {
    let region = TestRegion::new();
    let ledger = region.open();
    ledger.set_quota(DEV, 100).unwrap();
    ledger.try_reserve(DEV, 90).unwrap();
    ledger.set_overhead(DEV, 30).unwrap();
    assert_eq!(ledger.usage(DEV).unwrap().used, 120);
    assert_eq!(ledger.usage(DEV).unwrap().peak, 120);
    assert!(matches!(
        ledger.try_reserve(DEV, 1),
        Err(LedgerError::OverQuota { used: 120, .. })
    ));
    ledger.set_overhead(DEV, 5).unwrap();
    assert_eq!(ledger.usage(DEV).unwrap().used, 95);
    assert_eq!(ledger.process_overhead(DEV).unwrap(), 5);
    assert_eq!(ledger.process_usage(DEV).unwrap(), 90);
    ledger.try_reserve(DEV, 5).unwrap();
    assert!(ledger.try_reserve(DEV, 1).is_err());
    ledger.set_overhead(DEV, 0).unwrap();
    assert_eq!(ledger.usage(DEV).unwrap().used, 95);
}

#[test]
fn drop_gives_back_and_region_persists() {
    let region = TestRegion::new();
    let keeper = region.open();
    {
        let ledger = region.open();
        ledger.set_quota(3, 1000).unwrap();
        ledger.try_reserve(3, 400).unwrap();
        ledger.set_overhead(3, 100).unwrap();
        assert_eq!(keeper.usage(3).unwrap().used, 500);
    }
    assert_eq!(
        keeper.usage(3).unwrap(),
        DeviceUsage {
            quota: 1000,
            used: 0,
            peak: 500
        }
    );
    drop(keeper);
    let again = region.open();
    assert_eq!(again.quota(3).unwrap(), 1000);
    let live = again
        .region()
        .processes
        .iter()
        .filter(|s| s.pid.load(Ordering::Relaxed) != 0)
        .count();
    assert_eq!(live, 1);
}

#[test]
fn device_beyond_max_is_an_error() {
    let region = TestRegion::new();
    let ledger = region.open();
    for result in [
        ledger.try_reserve(MAX_DEVICES, 1).map(|_| 0),
        ledger.release(MAX_DEVICES, 1),
        ledger.quota(MAX_DEVICES),
        ledger.set_quota(MAX_DEVICES, 1).map(|_| 0),
        ledger.set_overhead(MAX_DEVICES, 1).map(|_| 0),
        ledger.process_usage(MAX_DEVICES),
    ] {
        assert!(matches!(
            result,
            Err(LedgerError::NoSuchDevice {
                dev: MAX_DEVICES,
                max: MAX_DEVICES
            })
        ));
    }
    assert!(ledger.usage(usize::MAX).is_err());
}

#[test]
fn invalid_names_are_refused() {
    for name in ["", "a/b", "a\0b", ".", ".."] {
        assert!(
            matches!(
                PodLedger::open_named(name),
                Err(LedgerError::InvalidName { .. })
            ),
            "{name:?}"
        );
    }
    assert!(matches!(
        PodLedger::open(&"x".repeat(250)),
        Err(LedgerError::InvalidName { .. })
    ));
}

#[test]
fn foreign_regions_are_named() {
    let region = TestRegion::new();
    let raw = region.raw(REGION_SIZE);
    // SAFETY: the mapping is REGION_SIZE bytes, page-aligned, all atomics.
    let header = unsafe { &*(raw.base().as_ptr() as *const Header) };
    header.magic.store(0xdead_beef, Ordering::Relaxed);
    header.state.store(STATE_READY, Ordering::Release);
    assert!(matches!(
        region.open_err(),
        LedgerError::BadMagic {
            found: 0xdead_beef,
            ..
        }
    ));
    header.magic.store(MAGIC, Ordering::Relaxed);
    header.version.store(99, Ordering::Relaxed);
    assert!(matches!(
        region.open_err(),
        LedgerError::VersionMismatch {
            found: 99,
            expected: LAYOUT_VERSION,
            ..
        }
    ));
    header.version.store(LAYOUT_VERSION, Ordering::Relaxed);
    header.size.store(12, Ordering::Relaxed);
    assert!(matches!(
        region.open_err(),
        LedgerError::SizeMismatch { found: 12, .. }
    ));
    header.size.store(REGION_SIZE as u64, Ordering::Relaxed);
    header.state.store(7, Ordering::Relaxed);
    assert!(matches!(
        region.open_err(),
        LedgerError::BadState { found: 7, .. }
    ));
    header.state.store(STATE_READY, Ordering::Relaxed);
    region.open();
}

impl TestRegion {
    fn open_err(&self) -> LedgerError {
        PodLedger::open_with(
            &self.0,
            &Trust::own_or_root(None),
            &Creation::default(),
            Duration::from_millis(50),
        )
        .expect_err("open must fail")
    }
}

#[test]
fn wrong_length_region_is_a_size_mismatch() {
    let region = TestRegion::new();
    let _raw = region.raw(4096);
    assert!(matches!(
        region.open_err(),
        LedgerError::Shm(ShmError::Size { found: 4096, expected, .. }) if expected == REGION_SIZE as u64
    ));
}

#[test]
fn stuck_initialisation_times_out() {
    let region = TestRegion::new();
    let raw = region.raw(REGION_SIZE);
    // SAFETY: the mapping is REGION_SIZE bytes, page-aligned, all atomics.
    let header = unsafe { &*(raw.base().as_ptr() as *const Header) };
    header.state.store(STATE_INITIALIZING, Ordering::Release);
    assert!(matches!(
        region.open_err(),
        LedgerError::Timeout { waited_ms: 50, .. }
    ));
}

#[test]
fn zeroed_region_is_initialised_by_an_opener() {
    let region = TestRegion::new();
    let _raw = region.raw(REGION_SIZE);
    let ledger = region.open();
    assert_eq!(ledger.region().header.magic.load(Ordering::Relaxed), MAGIC);
    assert_eq!(
        ledger.usage(DEV).unwrap(),
        DeviceUsage {
            quota: 0,
            used: 0,
            peak: 0
        }
    );
}

#[test]
fn dead_process_is_reclaimed() {
    let region = TestRegion::new();
    let ledger = region.open();
    forge_slot(&ledger, DEAD_PID, 12345, own_pid_ns(), 2, 30);
    assert_eq!(ledger.usage(2).unwrap().used, 30);
    assert_eq!(ledger.reclaim_dead(), 30);
    assert_eq!(ledger.usage(2).unwrap().used, 0);
    let held = ledger
        .region()
        .processes
        .iter()
        .filter(|s| s.pid.load(Ordering::Relaxed) != 0)
        .count();
    assert_eq!(held, 1);
    assert_eq!(ledger.reclaim_dead(), 0);
}

#[test]
fn live_process_is_kept_and_reused_pid_is_reclaimed() {
    let region = TestRegion::new();
    let ledger = region.open();
    let (ppid, start) = parent();
    forge_slot(&ledger, ppid, start, own_pid_ns(), DEV, 10);
    assert_eq!(ledger.reclaim_dead(), 0);
    // Same pid, another start time: the pid was reused.
    forge_slot(&ledger, ppid, start + 1, own_pid_ns(), DEV, 7);
    assert_eq!(ledger.reclaim_dead(), 7);
    assert_eq!(ledger.usage(DEV).unwrap().used, 10);
}

#[test]
fn other_pid_namespace_is_left_alone() {
    let region = TestRegion::new();
    let ledger = region.open();
    forge_slot(&ledger, DEAD_PID, 1, own_pid_ns().wrapping_add(1), DEV, 9);
    assert_eq!(ledger.reclaim_dead(), 0);
    assert_eq!(ledger.usage(DEV).unwrap().used, 9);
}

#[test]
fn mark_of_a_dead_reclaimer_is_taken_over() {
    let region = TestRegion::new();
    let ledger = region.open();
    forge_slot(&ledger, -DEAD_PID, 0, own_pid_ns(), DEV, 11);
    assert_eq!(ledger.reclaim_dead(), 11);
    assert_eq!(ledger.usage(DEV).unwrap().used, 0);
}

#[test]
fn over_quota_reserve_reclaims_first() {
    let region = TestRegion::new();
    let ledger = region.open();
    ledger.set_quota(DEV, 100).unwrap();
    ledger.try_reserve(DEV, 1).unwrap(); // spends the periodic scan
    forge_slot(&ledger, DEAD_PID, 0, own_pid_ns(), DEV, 80);
    ledger.try_reserve(DEV, 90).unwrap();
    assert_eq!(ledger.usage(DEV).unwrap().used, 91);
}

#[test]
fn full_table_reclaims_then_errors() {
    let region = TestRegion::new();
    let ledger = region.open();
    let (ppid, start) = parent();
    for _ in 1..MAX_PROCESSES {
        forge_slot(&ledger, ppid, start, own_pid_ns(), DEV, 0);
    }
    assert!(matches!(
        PodLedger::open_named(&region.0),
        Err(LedgerError::TableFull {
            max: MAX_PROCESSES,
            ..
        })
    ));
    // One dead among them: its slot is reclaimed and reused.
    ledger.region().processes[7]
        .start_time
        .store(start + 1, Ordering::Release);
    let second = region.open();
    assert_eq!(unpack(second.reg.load(Ordering::Relaxed)).1, 7);
}

#[test]
fn slot_taken_from_us_is_registered_again() {
    let region = TestRegion::new();
    let ledger = region.open();
    let (_, first) = unpack(ledger.reg.load(Ordering::Relaxed));
    // A peer wrongly judged us dead and the slot went to another process.
    let (ppid, start) = parent();
    let slot = &ledger.region().processes[first];
    slot.start_time.store(start, Ordering::Release);
    slot.pid.store(ppid, Ordering::Release);
    ledger.try_reserve(DEV, 5).unwrap();
    let (_, second) = unpack(ledger.reg.load(Ordering::Relaxed));
    assert_ne!(first, second);
    assert_eq!(ledger.process_usage(DEV).unwrap(), 5);
}

#[test]
fn proc_stat_parses_awkward_comm() {
    let (_, start) = parent();
    assert!(start > 0);
    let own = read_proc_stat("/proc/self/stat").unwrap();
    assert!(own.start_time > 0 && own.state != 'Z');
    let dir = std::env::temp_dir().join(format!("ledger-stat-{}", std::process::id()));
    let fake = "42 (a) b ) c) S 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 987654 20 21\n";
    std::fs::write(&dir, fake).unwrap();
    let stat = read_proc_stat(dir.to_str().unwrap()).unwrap();
    std::fs::remove_file(&dir).unwrap();
    assert_eq!((stat.state, stat.start_time), ('S', 987654));
}

#[test]
fn concurrent_reservers_never_overshoot() {
    const THREADS: usize = 8;
    const ROUNDS: usize = 10_000;
    const UNIT: u64 = 1 << 20;
    const QUOTA: u64 = 3 * UNIT;
    let region = TestRegion::new();
    let ledger = Arc::new(region.open());
    ledger.set_quota(DEV, QUOTA).unwrap();
    let granted = Arc::new(AtomicUsize::new(0));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let ledger = Arc::clone(&ledger);
            let granted = Arc::clone(&granted);
            std::thread::spawn(move || {
                for _ in 0..ROUNDS {
                    if ledger.try_reserve(DEV, UNIT).is_ok() {
                        granted.fetch_add(1, Ordering::Relaxed);
                        assert!(ledger.usage(DEV).unwrap().used <= QUOTA);
                        assert_eq!(ledger.release(DEV, UNIT).unwrap(), UNIT);
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    let usage = ledger.usage(DEV).unwrap();
    assert_eq!(usage.used, 0);
    assert_eq!(ledger.process_usage(DEV).unwrap(), 0);
    assert!(usage.peak <= QUOTA, "peak {} over quota", usage.peak);
    assert!(granted.load(Ordering::Relaxed) > 0);
}

#[test]
fn spill_is_capped_pod_wide_and_kept_apart_from_device_usage() {
    let region = TestRegion::new();
    let a = region.open();
    let b = region.open();
    let dev = a.device_for("GPU-spill").expect("entry");
    a.set_quota(dev, 100).expect("quota");
    a.try_reserve(dev, 100)
        .expect("device memory up to the quota");
    // No spill without a cap.
    assert!(matches!(
        a.try_spill_under(dev, 1, 0),
        Err(LedgerError::OverSpillCap { cap: 0, .. })
    ));
    a.try_spill_under(dev, 60, 100).expect("a spills 60");
    b.try_spill_under(dev, 40, 100).expect("b spills 40");
    match b.try_spill_under(dev, 1, 100) {
        Err(LedgerError::OverSpillCap {
            spilled: 100,
            requested: 1,
            ..
        }) => {}
        other => panic!("expected the cap, got {other:?}"),
    }
    assert_eq!(a.usage(dev).expect("usage").used, 100);
    let usage = a.spill_usage(dev).expect("spill");
    assert_eq!((usage.spilled, usage.peak), (100, 100));
    assert_eq!(a.process_spill(dev).expect("mine"), 60);
    // A release gives back only what this process held.
    assert_eq!(b.release_spill(dev, 60).expect("release"), 40);
    assert_eq!(a.spill_usage(dev).expect("spill").spilled, 60);
    // Dropping a process's handle gives its spill back with its memory.
    drop(a);
    let usage = b.spill_usage(dev).expect("spill");
    assert_eq!((usage.spilled, usage.peak), (0, 100));
    assert_eq!(b.usage(dev).expect("usage").used, 0);
}

#[test]
fn a_shrunk_ledger_refuses_reservations_and_does_not_crash() {
    let region = TestRegion::new();
    let ledger = region.open();
    ledger
        .try_reserve_under(DEV, 1 << 20, 1 << 30)
        .expect("reserve");
    // Any process that may write the region can shrink it.
    std::fs::OpenOptions::new()
        .write(true)
        .open(format!("/dev/shm/{}", region.0))
        .expect("open")
        .set_len(0)
        .expect("shrink");
    // Every page is now past the end: reading the usage touches one.
    let usage = ledger.usage(DEV).expect("usage");
    assert_eq!(usage.used, 0, "the lost count reads as zero");
    assert!(ledger.is_shrunk());
    let refused = ledger.try_reserve_under(DEV, 1, 1 << 30);
    assert!(
        matches!(refused, Err(LedgerError::Shrunk { .. })),
        "{refused:?}"
    );
    let refused = ledger.try_spill_under(DEV, 1, 1 << 30);
    assert!(
        matches!(refused, Err(LedgerError::Shrunk { .. })),
        "{refused:?}"
    );
}

#[test]
fn a_context_is_reserved_against_the_quota_before_it_is_taken() {
    let region = TestRegion::new();
    let ledger = region.open();
    let quota = 1000;
    ledger
        .try_reserve_under(DEV, 100, quota)
        .expect("an allocation");
    ledger
        .try_raise_overhead_under(DEV, 600, quota)
        .expect("a context that fits");
    assert_eq!(ledger.usage(DEV).expect("usage").used, 700);
    // A second context would pass the quota: refused, nothing charged.
    let refused = ledger.try_raise_overhead_under(DEV, 1000, quota);
    assert!(
        matches!(
            refused,
            Err(LedgerError::OverQuota {
                requested: 400,
                used: 700,
                ..
            })
        ),
        "{refused:?}"
    );
    assert_eq!(ledger.process_overhead(DEV).expect("overhead"), 600);
    // Already held: raising to less changes nothing.
    ledger
        .try_raise_overhead_under(DEV, 500, quota)
        .expect("no-op");
    assert_eq!(ledger.usage(DEV).expect("usage").used, 700);
    // The measurement replaces the estimate.
    ledger.set_overhead(DEV, 300).expect("measured");
    assert_eq!(ledger.usage(DEV).expect("usage").used, 400);
    // A dead process's context is given back before refusing.
    forge_slot(&ledger, DEAD_PID, 1, own_pid_ns(), DEV, 500);
    ledger
        .try_raise_overhead_under(DEV, 800, quota)
        .expect("fits once the dead process's bytes are back");
    assert_eq!(ledger.usage(DEV).expect("usage").used, 900);
    assert_eq!(ledger.context_bytes(DEV).expect("context"), 0);
    ledger.learn_context_bytes(DEV, 300).expect("learn");
    ledger.learn_context_bytes(DEV, 200).expect("learn");
    assert_eq!(ledger.context_bytes(DEV).expect("context"), 300);
}

#[test]
fn a_device_entry_moved_to_another_gpu_keeps_its_index_and_usage() {
    let region = TestRegion::new();
    let ledger = region.open();
    let a = ledger.device_for("GPU-a").expect("entry");
    ledger.set_quota(a, 1 << 30).expect("quota");
    ledger.try_reserve(a, 4096).expect("reserve");
    // A stale entry of the target, holding nothing, gives way.
    let stale = ledger.device_for("GPU-b").expect("entry");
    ledger.relocate_device("gpu-A", "GPU-b").expect("moved");
    assert_eq!(ledger.device_for("GPU-b").expect("entry"), a);
    assert_eq!(ledger.usage(a).expect("usage").used, 4096);
    assert_eq!(ledger.device_for("GPU-a").expect("entry"), stale);
    // Back again, then a target that holds memory refuses.
    ledger
        .relocate_device("GPU-b", "GPU-a")
        .expect("moved back");
    assert_eq!(ledger.device_for("GPU-a").expect("entry"), a);
    let busy = ledger.device_for("GPU-c").expect("entry");
    ledger.try_reserve(busy, 1).expect("reserve");
    assert!(matches!(
        ledger.relocate_device("GPU-a", "GPU-c"),
        Err(LedgerError::DeviceInUse { .. })
    ));
    assert_eq!(ledger.device_for("GPU-a").expect("entry"), a, "unchanged");
    // A GPU the pod never used: nothing to move.
    ledger
        .relocate_device("GPU-z", "GPU-y")
        .expect("nothing to move");
    ledger.release(busy, 1).expect("release");
    ledger.release(a, 4096).expect("release");
}
