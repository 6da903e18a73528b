//! The shared-memory readers under arbitrary contents: whatever a pod (or
//! anyone who may write an object) leaves in its ledger, limits or the node
//! tables, opening and reading them answers (a value or a typed error),
//! never panics; and shrinking the object at any point while it is mapped
//! kills nobody (see `shm::guard`).

use std::sync::atomic::{AtomicUsize, Ordering};

use gpushare_utils::activity::{ACTIVITY_LAYOUT, NodeActivity};
use gpushare_utils::ledger::{LAYOUT_VERSION, MAGIC, MAX_DEVICES, PodLedger, REGION_SIZE};
use gpushare_utils::limits::{LIMITS_MAGIC, LIMITS_SIZE, LIMITS_VERSION, PodLimits};
use gpushare_utils::node_table::{FUTURE_SLACK_NS, NodeTable, TableAccess, TableLayout};
use gpushare_utils::priority::{
    LatencyView, MAX_IN_FLIGHT, MAX_PERIOD_NS, NodePriority, PRIORITY_LAYOUT,
};
use gpushare_utils::shm::Trust;
use proptest::prelude::*;

/// An object of its own under `/dev/shm`, removed when dropped.
struct Object(String);

impl Object {
    fn new(kind: &str) -> Self {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        Self(format!(
            "gpushare-fuzz-{kind}-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
    }

    fn path(&self) -> String {
        format!("/dev/shm/{}", self.0)
    }

    /// Writes `bytes`, mode 0600: what any writer of the object could leave.
    fn write(&self, bytes: &[u8]) {
        use std::os::unix::fs::OpenOptionsExt;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(self.path())
            .expect("write object");
        std::io::Write::write_all(&mut file, bytes).expect("write");
    }

    fn shrink(&self, len: u64) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.path())
            .expect("open")
            .set_len(len)
            .expect("shrink");
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.path());
    }
}

/// Random bytes of `size`, with the valid header of the layout (`header`)
/// written over the start half of the time, so that readers go past it.
fn contents(size: usize, header: Vec<u8>) -> impl Strategy<Value = Vec<u8>> {
    (
        prop::collection::vec(any::<u8>(), 0..512),
        any::<bool>(),
        any::<u64>(),
        prop_oneof![Just(size), 0..size + 8192],
    )
        .prop_map(move |(noise, with_header, seed, len)| {
            // Noise repeated over the whole length, varied by the seed.
            let mut bytes: Vec<u8> = (0..len)
                .map(|i| {
                    let n = noise.get(i % noise.len().max(1)).copied().unwrap_or(0);
                    n ^ (seed.rotate_left((i % 64) as u32) as u8)
                })
                .collect();
            if with_header && bytes.len() >= header.len() {
                bytes[..header.len()].copy_from_slice(&header);
            }
            bytes
        })
}

fn ledger_header() -> Vec<u8> {
    let mut header = Vec::new();
    header.extend(MAGIC.to_le_bytes());
    header.extend(LAYOUT_VERSION.to_le_bytes());
    header.extend(2u32.to_le_bytes()); // ready
    header.extend((REGION_SIZE as u64).to_le_bytes());
    header
}

fn limits_header() -> Vec<u8> {
    let mut header = Vec::new();
    header.extend(LIMITS_MAGIC.to_le_bytes());
    header.extend(LIMITS_VERSION.to_le_bytes());
    header.extend(2u32.to_le_bytes()); // published
    header
}

/// The 64-byte header a node table's creator writes for `layout`.
fn node_table_header(layout: &TableLayout) -> Vec<u8> {
    let mut header = Vec::new();
    header.extend(layout.magic.to_le_bytes());
    header.extend(layout.version.to_le_bytes());
    header.extend(64u32.to_le_bytes());
    header.extend(layout.size.to_le_bytes());
    header.extend(layout.shape.to_le_bytes());
    header.extend([0u8; 32]);
    header
}

fn table_size(layout: &TableLayout) -> usize {
    usize::try_from(layout.size).expect("a table's size")
}

fn uuid() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("GPU-00000000-0000-0000-0000-000000000000".to_owned()),
        ".{0,40}"
    ]
}

/// Where the object is shrunk to while mapped, if at all.
fn shrink_to() -> impl Strategy<Value = Option<u64>> {
    prop_oneof![Just(None), (0u64..8192).prop_map(Some)]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn ledger_readers_answer_whatever_the_region_holds(
        bytes in contents(REGION_SIZE, ledger_header()),
        uuid in uuid(),
        dev in 0..MAX_DEVICES + 2,
        shrink in shrink_to(),
    ) {
        let object = Object::new("ledger");
        object.write(&bytes);
        if let Ok(ledger) = PodLedger::open_named(&object.0) {
            if let Some(len) = shrink {
                object.shrink(len);
            }
            let _ = ledger.device_for(&uuid);
            let _ = ledger.usage(dev);
            let _ = ledger.spill_usage(dev);
            let _ = ledger.compute(dev).map(|bucket| bucket.refill_now(1_000_000));
            let _ = ledger.try_reserve_under(dev, 1 << 20, 1 << 30);
            let _ = ledger.release(dev, 1 << 20);
            let _ = ledger.try_raise_overhead_under(dev, 1 << 20, 1 << 30);
            let _ = ledger.reclaim_dead();
            let _ = ledger.pids_in_own_namespace();
            if shrink.is_some_and(|len| len < 4096) {
                // Every page was touched past the end: the counts are gone.
                prop_assert!(ledger.try_reserve_under(0, 1, 0).is_err());
            }
        }
    }

    #[test]
    fn limits_readers_answer_whatever_the_object_holds(
        bytes in contents(LIMITS_SIZE, limits_header()),
        uuid in uuid(),
        shrink in shrink_to(),
    ) {
        let object = Object::new("limits");
        // The reader finds limits by pod name: `gpushare-limits-<pod>`.
        let pod = object.0.clone();
        let limits_object = Object(PodLimits::name_of(&pod));
        limits_object.write(&bytes);
        if let Ok(limits) = PodLimits::open_read_only(&pod, &Trust::own_or_root(None)) {
            if let Some(len) = shrink {
                limits_object.shrink(len);
            }
            if let Some(gpu) = limits.find(&uuid) {
                let _ = gpu.class();
                let _ = gpu.quota.load(Ordering::Acquire);
            }
            for gpu in &limits.region().gpus {
                let _ = gpu.class();
            }
        }
    }

    #[test]
    fn node_table_readers_answer_whatever_the_tables_hold(
        activity in contents(table_size(&ACTIVITY_LAYOUT), node_table_header(&ACTIVITY_LAYOUT)),
        priority in contents(table_size(&PRIORITY_LAYOUT), node_table_header(&PRIORITY_LAYOUT)),
        pod in any::<u64>(),
        device in 0..MAX_DEVICES + 2,
        now in any::<u64>(),
        shrink in shrink_to(),
    ) {
        let (a, p) = (Object::new("activity"), Object::new("priority"));
        a.write(&activity);
        p.write(&priority);
        let access = TableAccess::managed(None);
        if let Ok(table) = NodeActivity::open_named(&a.0, &access) {
            if let Some(len) = shrink {
                a.shrink(len);
            }
            table.mark(device, pod, now);
            let contended = table.contended(device, pod, now);
            prop_assert!(table.is_sound() || !contended, "a table with a wrong header read");
            let _ = table.header_is_exact();
        }
        if let Ok(table) = NodePriority::open_named(&p.0, &access) {
            if let Some(len) = shrink {
                p.shrink(len);
            }
            let line = table.latency(device, now);
            // A wrong header is no table; otherwise only what may be true.
            if !table.is_sound() {
                prop_assert_eq!(line, LatencyView::default());
            }
            let bound = now.saturating_add(FUTURE_SLACK_NS);
            prop_assert!(line.active_at_ns <= bound && line.present_at_ns <= bound);
            prop_assert!(line.in_flight <= MAX_IN_FLIGHT && line.period_ns <= MAX_PERIOD_NS);
            prop_assert!(line.next_arrival_ns <= bound.saturating_add(line.period_ns));
            let _ = table.contended(device, now);
            let _ = table.header_is_exact();
            let _ = table.stats(pod);
            if let Some(line) = table.device(device) {
                line.stamp_active(now);
                line.enter_flight(now);
                let _ = line.drop_stale_flight(now);
                line.leave_flight(now);
            }
        }
    }
}
