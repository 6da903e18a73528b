use super::*;
use crate::node_table::{FUTURE_SLACK_NS, pod_key};

const US: u64 = 1_000;
const MS: u64 = 1_000_000;

struct Table(String, NodePriority);

impl Table {
    fn new(test: &str) -> Self {
        let name = format!("gpushare-priority-test-{}-{test}", std::process::id());
        let table = NodePriority::open_named(&name, &TableAccess::local(None)).expect("map");
        Self(name, table)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let _ignored = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

#[test]
fn counts_of_a_process_dead_in_flight_are_dropped() {
    let table = Table::new("dead");
    let line = table.1.device(0).expect("line");
    let t = 1_000 * MS;
    line.present_at_ns.store(t, Ordering::Relaxed);
    // A process enters flight and dies there.
    line.enter_flight(t);
    // Another latency process enters and leaves within the grace: the
    // dead count is still trusted (it cannot tell yet).
    line.enter_flight(t + FLIGHT_GRACE_NS / 2);
    line.leave_flight(t + FLIGHT_GRACE_NS / 2 + 300 * US);
    assert_eq!(line.in_flight.load(Ordering::Relaxed), 1);
    assert_eq!(
        table.1.latency(0, t + MS).in_flight,
        1,
        "still counted in flight"
    );
    // Its next request, after a quiet grace: the dead count goes.
    let next = t + 3 * FLIGHT_GRACE_NS;
    line.enter_flight(next);
    assert_eq!(line.in_flight.load(Ordering::Relaxed), 1);
    line.leave_flight(next + 300 * US);
    assert_eq!(
        table.1.latency(0, next + MS).in_flight,
        0,
        "the dead count dropped"
    );
    // A live process in flight refreshes the line: never dropped.
    line.enter_flight(next + 2 * MS);
    line.stamp_active(next + 2 * MS + FLIGHT_GRACE_NS);
    assert!(!line.drop_stale_flight(next + 2 * MS + FLIGHT_GRACE_NS + 10 * US));
    assert!(line.drop_stale_flight(next + 4 * MS + FLIGHT_GRACE_NS));
    assert!(!line.drop_stale_flight(next + 5 * MS + FLIGHT_GRACE_NS));
}

#[test]
fn two_mappings_share_lines_and_counters() {
    let table = Table::new("shared");
    let other =
        NodePriority::open_named(&table.0, &TableAccess::managed(None)).expect("second map");
    let now = 5_000 * MS;
    let line = other.device(2).expect("line");
    line.stamp_active(now);
    line.stamp_active(now - MS);
    line.present_at_ns.store(now, Ordering::Relaxed);
    // The latest stamp stays; the other mapping reads what this one wrote.
    let seen = table.1.latency(2, now);
    assert_eq!((seen.active_at_ns, seen.present_at_ns), (now, now));
    assert_eq!(table.1.latency(1, now), LatencyView::default());
    assert_eq!(table.1.latency(MAX_DEVICES, now), LatencyView::default());
    line.enter_flight(now);
    assert_eq!(table.1.latency(2, now).in_flight, 1);
    line.leave_flight(now + 20 * MS);
    line.leave_flight(now + 20 * MS);
    assert_eq!(
        table.1.latency(2, now + 20 * MS).in_flight,
        0,
        "never below zero"
    );

    // A held batch pod's launches: seen by the other mapping for the
    // window, refreshed at most once per refresh interval.
    let seen = table.1.device(2).expect("line");
    assert!(!seen.contended(now), "never stamped");
    line.stamp_contended(now);
    line.stamp_contended(now + CONTENDED_REFRESH_NS / 2);
    assert_eq!(seen.contended_at_ns.load(Ordering::Relaxed), now);
    line.stamp_contended(now + CONTENDED_REFRESH_NS);
    let last = now + CONTENDED_REFRESH_NS;
    assert!(seen.contended(last + CONTENDED_WINDOW_NS - 1));
    assert!(!seen.contended(last + CONTENDED_WINDOW_NS));
    assert!(!table.1.device(1).expect("line").contended(now));

    let (batch, latency) = (pod_key("batch"), pod_key("latency"));
    let slot = other.slot(0, batch, PodClass::Batch, now).expect("slot");
    slot.add_hold(3 * MS);
    other
        .slot(1, batch, PodClass::Batch, now)
        .expect("slot")
        .add_hold(MS);
    let slot = other
        .slot(0, latency, PodClass::Latency, now)
        .expect("slot");
    slot.add_queue_delay(40 * US);
    slot.add_queue_delay(10 * US);
    let stats = table.1.stats(batch).expect("batch stats");
    assert_eq!(
        (stats.class, stats.held_ns, stats.held_launches),
        (PodClass::Batch, 4 * MS, 2)
    );
    let stats = table.1.stats(latency).expect("latency stats");
    assert_eq!(stats.class, PodClass::Latency);
    assert_eq!(
        (stats.queue_ns, stats.queue_samples, stats.queue_max_ns),
        (50 * US, 2, 40 * US)
    );
    assert_eq!(table.1.stats(pod_key("nobody")), None);
}

#[test]
fn a_wrong_header_makes_the_table_read_as_none() {
    let table = Table::new("header");
    assert!(table.1.is_sound() && table.1.header_is_exact());
    let now = 5_000 * MS;
    let line = table.1.device(0).expect("line");
    line.stamp_active(now);
    line.present_at_ns.store(now, Ordering::Relaxed);
    line.stamp_contended(now);
    let batch = pod_key("batch");
    table
        .1
        .slot(0, batch, PodClass::Batch, now)
        .expect("slot")
        .add_hold(MS);
    assert_eq!(table.1.latency(0, now).active_at_ns, now);
    // Random bytes over the header (the first 64 bytes of the table).
    let header = table.1.header();
    for (word, value) in [
        (&header.magic, 0x3c6e_f372_fe94_f82b_u64),
        (&header.size, 0xa54f_f53a_5f1d_36f1),
        (&header.shape, 0x510e_527f_ade6_82d1),
    ] {
        word.store(value, Ordering::Relaxed);
    }
    assert!(!table.1.is_sound());
    assert_eq!(table.1.latency(0, now), LatencyView::default());
    assert!(!table.1.contended(0, now));
    assert_eq!(table.1.stats(batch), None);
    // Only the version wrong is as wrong.
    header.write(&PRIORITY_LAYOUT);
    header
        .version
        .store(PRIORITY_VERSION + 1, Ordering::Relaxed);
    assert_eq!(table.1.latency(0, now), LatencyView::default());
    header.write(&PRIORITY_LAYOUT);
    assert!(table.1.header_is_exact());
    assert_eq!(table.1.latency(0, now).active_at_ns, now);
    assert!(table.1.contended(0, now));
    assert_eq!(table.1.stats(batch).map(|s| s.held_ns), Some(MS));
}

#[test]
fn values_no_writer_could_have_written_are_ignored() {
    let now = 5_000 * MS;
    let sane = LatencyView {
        active_at_ns: now - MS,
        in_flight: 2,
        present_at_ns: now + FUTURE_SLACK_NS,
        next_arrival_ns: now + 2 * MS,
        period_ns: 2 * MS,
    };
    assert_eq!(sane.plausible(now), sane, "all of it may be true");
    // (forged line, what a reader believes)
    let table: &[(LatencyView, LatencyView)] = &[
        (
            LatencyView {
                active_at_ns: u64::MAX,
                present_at_ns: now + FUTURE_SLACK_NS + 1,
                ..sane
            },
            LatencyView {
                active_at_ns: 0,
                present_at_ns: 0,
                ..sane
            },
        ),
        (
            LatencyView {
                in_flight: MAX_IN_FLIGHT + 1,
                ..sane
            },
            LatencyView {
                in_flight: 0,
                ..sane
            },
        ),
        (
            LatencyView {
                next_arrival_ns: now + 2 * MS + FUTURE_SLACK_NS + 1,
                ..sane
            },
            LatencyView {
                next_arrival_ns: 0,
                period_ns: 0,
                ..sane
            },
        ),
        (
            LatencyView {
                next_arrival_ns: now + 1,
                period_ns: MAX_PERIOD_NS + 1,
                ..sane
            },
            LatencyView {
                next_arrival_ns: 0,
                period_ns: 0,
                ..sane
            },
        ),
    ];
    for &(forged, believed) in table {
        assert_eq!(forged.plausible(now), believed, "{forged:?}");
    }
}

#[test]
fn garbage_on_a_line_neither_holds_readers_nor_blocks_writers() {
    let table = Table::new("garbage");
    let line = table.1.device(0).expect("line");
    for word in [
        &line.active_at_ns,
        &line.present_at_ns,
        &line.in_flight,
        &line.next_arrival_ns,
        &line.contended_at_ns,
    ] {
        word.store(u64::MAX - 7, Ordering::Relaxed);
    }
    line.period_ns.store(MS, Ordering::Relaxed);
    let now = 5_000 * MS;
    assert_eq!(table.1.latency(0, now), LatencyView::default());
    assert!(!table.1.contended(0, now));
    // A latency pod's stamps and a batch pod's replace it.
    line.stamp_active(now);
    line.stamp_contended(now);
    assert_eq!(table.1.latency(0, now).active_at_ns, now);
    assert!(table.1.contended(0, now));
    // The garbage count goes once the line is quiet.
    line.active_at_ns.store(u64::MAX, Ordering::Relaxed);
    assert!(line.drop_stale_flight(now));
    assert_eq!(line.in_flight.load(Ordering::Relaxed), 0);
    // A slot stamped from the future is free to take; counters that
    // contradict each other are left out of the stats.
    let slot = &table.1.table.pods[0][0];
    slot.pod.store(0xdead, Ordering::Relaxed);
    slot.seen_at_ns.store(u64::MAX, Ordering::Relaxed);
    let pod = pod_key("pod");
    let mine = table.1.slot(0, pod, PodClass::Batch, now).expect("slot");
    assert!(std::ptr::eq(mine, slot));
    mine.held_ns.store(u64::MAX, Ordering::Relaxed);
    assert_eq!(table.1.stats(pod), None, "time held by no launch");
    mine.held_launches.store(1, Ordering::Relaxed);
    let other = table.1.slot(1, pod, PodClass::Batch, now).expect("slot");
    other.add_hold(MS);
    assert_eq!(table.1.stats(pod).map(|s| s.held_ns), Some(u64::MAX));
}

#[test]
fn full_devices_refuse_and_stale_slots_are_reused() {
    let table = Table::new("full");
    for pod in 0..PODS_PER_DEVICE as u64 {
        assert!(table.1.slot(0, pod + 10, PodClass::Batch, MS).is_some());
    }
    assert!(table.1.slot(0, 999, PodClass::Batch, 2 * MS).is_none());
    let slot = table.1.slot(0, 999, PodClass::Batch, STALE_NS + 2 * MS);
    assert_eq!(slot.map(|s| s.held_ns.load(Ordering::Relaxed)), Some(0));
}
