use std::time::{Duration, Instant};

use super::*;
use crate::node_table::TableAccess;
use crate::priority::NodePriority;

const US: u64 = 1_000;
const MS: u64 = 1_000_000;
const QUANTUM_US: u32 = 5_000;
const T: u64 = 1_000_000 * MS;

struct Table(String, NodePriority);

impl Table {
    fn new(test: &str) -> Self {
        let name = format!("gpushare-turns-test-{}-{test}", std::process::id());
        let table = NodePriority::open_named(&name, &TableAccess::local(None)).expect("map");
        Self(name, table)
    }

    /// A GPU's line taking turns of [`QUANTUM_US`], and the slots of `pods`,
    /// claimed a second before `T` (none of them wants a turn at `T`).
    fn line(&self, pods: &[&str]) -> (&'static TurnLine, Vec<usize>) {
        let line = self.1.claim_turn_line(0xfeed).expect("line");
        line.set_quantum_us(QUANTUM_US);
        let slots = pods
            .iter()
            .map(|pod| {
                line.slot(crate::node_table::pod_key(pod), T - 1_000 * MS)
                    .expect("slot")
            })
            .collect();
        (line, slots)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let _ignored = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

fn holder(line: &TurnLine) -> Option<usize> {
    usize::try_from(line.turn.load(Ordering::Relaxed) >> HOLDER_SHIFT)
        .ok()
        .and_then(|slot| slot.checked_sub(1))
}

#[test]
fn two_pods_take_turns_of_the_quantum() {
    let table = Table::new("two");
    let (line, slots) = table.line(&["a", "b"]);
    let (a, b) = (slots[0], slots[1]);
    assert_eq!(
        line.take(a, T),
        TurnStep::Go,
        "a free GPU is the first pod's"
    );
    // b wants the GPU inside a's turn, while a launches: it waits, at most
    // a wait slice.
    line.want(a, T + MS);
    let TurnStep::Wait { until_ns, .. } = line.take(b, T + MS) else {
        panic!("b launched in a's turn");
    };
    assert_ne!(a, b);
    assert_eq!(until_ns, T + MS + WAIT_SLICE_NS);
    assert_eq!(
        line.take(a, T + 4 * MS),
        TurnStep::Go,
        "a's turn lasts 5 ms"
    );
    // a's next launch after its turn hands the turn to b, which wants it.
    assert!(matches!(line.take(a, T + 5 * MS), TurnStep::Wait { .. }));
    assert_eq!(holder(line), Some(b));
    assert_eq!(line.take(b, T + 5 * MS + 10 * US), TurnStep::Go);
    assert_eq!(line.handovers.load(Ordering::Relaxed), 1);
    // b goes idle (no stamp for IDLE_NS): a takes the turn back before
    // b's turn ends.
    line.want(a, T + 5 * MS + 20 * US);
    assert_eq!(line.take(a, T + 5 * MS + 10 * US + IDLE_NS), TurnStep::Go);
    assert_eq!(holder(line), Some(a));
}

#[test]
fn a_turn_is_held_since_it_began_until_it_ends_or_passes() {
    let table = Table::new("held");
    let (line, slots) = table.line(&["a", "b"]);
    let (a, b) = (slots[0], slots[1]);
    assert_eq!(line.held_since(a, T), None, "nobody's turn yet");
    assert_eq!(line.take(a, T), TurnStep::Go);
    assert_eq!(line.held_since(a, T + MS), Some(T));
    assert_eq!(line.held_since(b, T + MS), None, "not b's");
    assert_eq!(
        line.held_since(a, T + 5 * MS),
        None,
        "a's turn of 5 ms has ended"
    );
    // Kept past its end (nobody else wants one): a new turn, begun when taken.
    assert_eq!(line.take(a, T + 6 * MS), TurnStep::Go);
    assert_eq!(line.held_since(a, T + 7 * MS), Some(T + 6 * MS));
    // Passed on to b, which wants one: b's from then.
    line.want(b, T + 7 * MS);
    line.pass(a, T + 8 * MS);
    assert_eq!(line.held_since(a, T + 8 * MS + US), None);
    assert_eq!(line.held_since(b, T + 8 * MS + US), Some(T + 8 * MS));
    // A GPU that stops taking turns has no holder.
    line.set_quantum_us(0);
    assert_eq!(line.held_since(b, T + 9 * MS), None);
}

#[test]
fn a_pod_alone_keeps_the_turn_past_its_end() {
    let table = Table::new("alone");
    let (line, slots) = table.line(&["a", "b"]);
    assert_eq!(line.take(slots[0], T), TurnStep::Go);
    // b's stamp is older than WANT_NS: it does not want a turn.
    for k in 1..10 {
        assert_eq!(line.take(slots[0], T + k * 3 * MS), TurnStep::Go);
    }
    assert_eq!(line.handovers.load(Ordering::Relaxed), 0);
}

#[test]
fn turns_go_round_in_slot_order_to_the_pods_that_want_them() {
    let table = Table::new("round");
    let (line, slots) = table.line(&["a", "b", "c", "d"]);
    let (a, b, c, d) = (slots[0], slots[1], slots[2], slots[3]);
    assert_eq!(line.take(a, T), TurnStep::Go);
    // c and d want turns, b does not.
    line.want(a, T + MS);
    assert!(matches!(line.take(d, T + MS), TurnStep::Wait { .. }));
    assert!(matches!(line.take(c, T + MS), TurnStep::Wait { .. }));
    let mut order = Vec::new();
    let mut now = T + 5 * MS;
    for _ in 0..6 {
        // Every pod that wants one asks at the turn's end; the holder first.
        let held = holder(line).expect("held");
        for pod in [held, a, c, d] {
            let _ = line.take(pod, now);
        }
        order.push(holder(line).expect("held"));
        now += 5 * MS;
    }
    assert_eq!(order, [c, d, a, c, d, a], "b never wanted one");
    assert!(!order.contains(&b));
}

#[test]
fn a_pod_out_of_budget_passes_its_turn() {
    let table = Table::new("pass");
    let (line, slots) = table.line(&["a", "b"]);
    let (a, b) = (slots[0], slots[1]);
    assert_eq!(line.take(a, T), TurnStep::Go);
    // Nobody else wants it: passing keeps it.
    line.pass(a, T + MS);
    assert_eq!(holder(line), Some(a));
    line.want(a, T + MS);
    assert!(matches!(line.take(b, T + MS), TurnStep::Wait { .. }));
    // Only the holder passes.
    line.pass(b, T + 2 * MS);
    assert_eq!(holder(line), Some(a));
    line.pass(a, T + 2 * MS);
    assert_eq!(holder(line), Some(b));
    assert_eq!(line.take(b, T + 2 * MS + 10 * US), TurnStep::Go);
}

#[test]
fn a_turn_no_writer_could_have_written_reads_as_nobodys() {
    let table = Table::new("garbage");
    let (line, slots) = table.line(&["a"]);
    let now_us = T / US;
    for word in [
        // A holder past the slots.
        Turn::encode(200, now_us + 1_000),
        // An end a minute ahead.
        Turn::encode(3, now_us + 60_000_000),
    ] {
        line.turn.store(word, Ordering::Relaxed);
        assert_eq!(line.take(slots[0], T), TurnStep::Go, "{word:#x}");
        assert_eq!(holder(line), Some(slots[0]));
    }
    // The longest turn whatever the line says.
    line.quantum_us.store(u32::MAX, Ordering::Relaxed);
    assert_eq!(line.quantum_ns(), u64::from(MAX_QUANTUM_US) * US);
}

#[test]
fn a_gpu_without_turns_lets_every_launch_go() {
    let table = Table::new("none");
    let (line, slots) = table.line(&["a", "b"]);
    assert_eq!(line.take(slots[0], T), TurnStep::Go);
    assert!(matches!(
        line.take(slots[1], T + 10 * US),
        TurnStep::Wait { .. }
    ));
    line.set_quantum_us(0);
    assert_eq!(line.turn.load(Ordering::Relaxed), 0, "the turn handed back");
    assert_eq!(line.take(slots[1], T), TurnStep::Go);
    assert_eq!(line.take(slots[0], T), TurnStep::Go);
    // A line of another GPU is not this one's.
    assert!(table.1.turn_line(0xbeef).is_none());
    let other = table.1.claim_turn_line(0xbeef).expect("second line");
    assert!(!std::ptr::eq(other, line));
    assert!(std::ptr::eq(
        table.1.turn_line(0xfeed).expect("first"),
        line
    ));
}

#[test]
fn a_waiter_wakes_when_the_turn_is_handed_over() {
    let table = Table::new("wake");
    let (line, slots) = table.line(&["a", "b"]);
    let (a, b) = (slots[0], slots[1]);
    let now = crate::bucket::monotonic_ns();
    assert_eq!(line.take(a, now), TurnStep::Go);
    let TurnStep::Wait { wake, .. } = line.take(b, now) else {
        panic!("b launched in a's turn");
    };
    // Nothing changes: the wait lasts until its deadline.
    let started = Instant::now();
    line.wait(wake, crate::bucket::monotonic_ns() + 3 * MS);
    assert!(started.elapsed() >= Duration::from_millis(3));
    // a passes from another thread 20 ms into a 1 s wait: b wakes then.
    let started = Instant::now();
    std::thread::scope(|scope| {
        scope.spawn(|| {
            std::thread::sleep(Duration::from_millis(20));
            // b's waiting process stamps its slot every wait slice.
            line.want(b, crate::bucket::monotonic_ns());
            line.pass(a, crate::bucket::monotonic_ns());
        });
        line.wait(wake, crate::bucket::monotonic_ns() + 1_000 * MS);
    });
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(20) && waited < Duration::from_millis(500),
        "{waited:?}"
    );
    assert_eq!(line.take(b, crate::bucket::monotonic_ns()), TurnStep::Go);
}

#[test]
fn a_waiter_takes_a_turn_after_a_round_of_turns_whatever_the_line_says() {
    let table = Table::new("seize");
    let (line, slots) = table.line(&["victim", "hog"]);
    let (victim, hog) = (slots[0], slots[1]);
    let quantum_ns = u64::from(QUANTUM_US) * US;
    // A round of turns: one of each other pod (and the ms a holder is
    // given past its end), and a ms.
    assert_eq!(line.patience_ns(1, T), IDLE_NS);
    assert_eq!(line.patience_ns(3, T), 2 * (quantum_ns + IDLE_NS) + IDLE_NS);
    // Nobody counted the pods: those wanting a turn now.
    line.want(victim, T);
    line.want(hog, T);
    assert_eq!(line.patience_ns(0, T), quantum_ns + 2 * IDLE_NS);
    // The hog names itself the holder of a fresh turn: the victim waits.
    line.turn
        .store(Turn::encode(hog, (T + quantum_ns) / US), Ordering::Release);
    line.want(hog, T + MS);
    assert!(matches!(line.take(victim, T + MS), TurnStep::Wait { .. }));
    // Past its patience the victim takes a turn of a quantum; the line says so.
    let wake = line.wake.load(Ordering::Relaxed);
    let handovers = line.handovers.load(Ordering::Relaxed);
    assert_eq!(line.seize(victim, T + 7 * MS), T + 7 * MS + quantum_ns);
    assert_eq!(holder(line), Some(victim));
    assert_ne!(line.wake.load(Ordering::Relaxed), wake, "waiters woken");
    assert_eq!(line.handovers.load(Ordering::Relaxed), handovers + 1);
    assert_eq!(line.take(victim, T + 8 * MS), TurnStep::Go);
    // A GPU that takes no turns has none to seize.
    line.set_quantum_us(0);
    assert_eq!(line.seize(victim, T + 9 * MS), 0);
}
