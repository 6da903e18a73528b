//! Bracket overheads: what an event bracket around a sampled launch holds
//! besides its kernel, measured once per context, and the kernel's GPU time
//! a bracket gives once they are taken off.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use crate::driver::LaunchOverheads;

/// Contexts whose launch overhead is measured, at most.
const CALIBRATED_CONTEXTS: usize = 64;

/// The GPU time of a sampled launch out of its event bracket: less what the
/// bracket holds besides the kernel (`overhead`), and less `late`, how late
/// its kernel started for a slow launch call ([`late_ns`]). A kernel no
/// longer than the overhead still costs a quarter of the bracket it would
/// have had without `late`: a price never drops to nothing on an
/// overestimated overhead. Lateness the bracket cannot hold (the host's and
/// the GPU's clocks disagree) is not believed.
pub(super) fn kernel_ns(bracket: u64, overhead: u64, late: u64) -> u64 {
    let bracket = if late < bracket {
        bracket - late
    } else {
        bracket
    };
    bracket.saturating_sub(overhead).max(bracket / 4)
}

/// How late a kernel launched into an idle stream may have started for its
/// launch call taking `call` where calls typically take `typical`: what the
/// call took beyond twice that. A call's delay counts for its kernel only
/// if it came before the kernel was submitted; a module loaded in the call
/// does, and is long; a few hundred ns of jitter may come after (and a
/// kernel longer than the call then hides it), and taken off, they made a
/// 25% limit deliver 25.8% on the driver double.
fn late_ns(call: u64, typical: u64) -> u64 {
    call.saturating_sub(typical.saturating_mul(2))
}

/// The process's measured bracket overheads, and the contexts measured.
pub(super) struct Overheads {
    /// Contexts whose launch overhead was measured (0: a free slot).
    calibrated: [AtomicUsize; CALIBRATED_CONTEXTS],
    /// What a bracket holds beyond the launch's back-to-back period, from
    /// an idle stream and queued, kernels and graphs (see
    /// [`crate::driver::Timing::launch_overheads`]); 0 until measured.
    kernel_idle_extra_ns: AtomicU64,
    kernel_queued_extra_ns: AtomicU64,
    graph_idle_extra_ns: AtomicU64,
    graph_queued_extra_ns: AtomicU64,
    /// How long the kernel launch call typically took in the idle brackets;
    /// `u64::MAX` until measured (nothing counts as late).
    kernel_idle_call_ns: AtomicU64,
}

impl Default for Overheads {
    fn default() -> Self {
        Self {
            calibrated: [const { AtomicUsize::new(0) }; CALIBRATED_CONTEXTS],
            kernel_idle_extra_ns: AtomicU64::new(0),
            kernel_queued_extra_ns: AtomicU64::new(0),
            graph_idle_extra_ns: AtomicU64::new(0),
            graph_queued_extra_ns: AtomicU64::new(0),
            kernel_idle_call_ns: AtomicU64::new(u64::MAX),
        }
    }
}

impl Overheads {
    /// Claims the measurement of `context`'s overhead: true once per
    /// context, for the first caller. A lock-free set of contexts: the first
    /// empty slot is claimed unless the context is there already (or the
    /// set is full: the overhead of an earlier context stands for it).
    pub(super) fn claim(&self, context: usize) -> bool {
        let claimed = self.calibrated.iter().find_map(|slot| {
            match slot.compare_exchange(0, context, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => Some(true),
                Err(owner) if owner == context => Some(false),
                Err(_) => None,
            }
        });
        claimed == Some(true)
    }

    /// Keeps what a calibration measured; without graphs, a graph's launch
    /// is priced like a kernel's.
    pub(super) fn store(&self, overheads: &LaunchOverheads) {
        let extras = [
            (&self.kernel_idle_call_ns, overheads.kernel_idle_call_ns),
            (&self.kernel_idle_extra_ns, overheads.kernel_idle_ns),
            (&self.kernel_queued_extra_ns, overheads.kernel_queued_ns),
            (
                &self.graph_idle_extra_ns,
                overheads.graph_idle_ns.unwrap_or(overheads.kernel_idle_ns),
            ),
            (
                &self.graph_queued_extra_ns,
                overheads
                    .graph_queued_ns
                    .unwrap_or(overheads.kernel_queued_ns),
            ),
        ];
        for (extra, ns) in extras {
            extra.store(ns, Ordering::Relaxed);
        }
    }

    /// What a bracket of a launch holds besides its kernel, and how late the
    /// kernel started, for a launch of a graph or a kernel whose call took
    /// `call_ns`, into a stream idle for `idle_gap_ns` of host time before
    /// the call (`None`: queued behind earlier work).
    ///
    /// A launch queued behind earlier work is measured from that work's
    /// end: its back-to-back period plus the events' own time. From an idle
    /// stream the bracket also holds the host's way to the launch call, the
    /// launch latency, and for a kernel, however much longer than
    /// calibrated its call took (a module loaded in it: the kernel starts
    /// that much later). Not for a graph: its call grows with its nodes,
    /// whose work may start while the call still submits the rest, and the
    /// calibrated graph has one node.
    pub(super) fn of(&self, idle_gap_ns: Option<u64>, graph: bool, call_ns: u64) -> (u64, u64) {
        let load = |extra: &AtomicU64| extra.load(Ordering::Relaxed);
        match (idle_gap_ns, graph) {
            (None, true) => (load(&self.graph_queued_extra_ns), 0),
            (None, false) => (load(&self.kernel_queued_extra_ns), 0),
            (Some(gap), true) => (gap + load(&self.graph_idle_extra_ns), 0),
            (Some(gap), false) => (
                gap + load(&self.kernel_idle_extra_ns),
                late_ns(call_ns, load(&self.kernel_idle_call_ns)),
            ),
        }
    }

    /// For the exit summary: the kernel's idle and queued extras, and its
    /// typical idle call (0: not measured).
    pub(super) fn kernel_figures(&self) -> (u64, u64, u64) {
        (
            self.kernel_idle_extra_ns.load(Ordering::Relaxed),
            self.kernel_queued_extra_ns.load(Ordering::Relaxed),
            self.kernel_idle_call_ns.load(Ordering::Relaxed) % u64::MAX,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::{Overheads, kernel_ns, late_ns};

    #[test]
    fn a_bracket_is_charged_its_kernel_less_overhead_and_lateness() {
        // Queued: the events' own time taken off.
        assert_eq!(kernel_ns(50_000, 2_000, 0), 48_000);
        // From an idle stream, a call 1.5 µs slower than calibrated: a
        // 200 ns kernel in a 2 µs bracket with 300 ns of overhead.
        assert_eq!(kernel_ns(2_000, 300, 1_500), 200);
        // Lateness never counts against a kernel's floor: a quarter of the
        // bracket as a call as fast as calibrated would have made it.
        assert_eq!(kernel_ns(2_000, 600, 1_500), 125);
        assert_eq!(kernel_ns(2_000, 3_000, 0), 500);
        // Lateness the bracket cannot hold is not believed.
        assert_eq!(kernel_ns(1_000, 200, 5_000), 800);
    }

    #[test]
    fn a_call_is_late_only_beyond_twice_its_typical_length() {
        assert_eq!(late_ns(300, 200), 0);
        assert_eq!(late_ns(400, 200), 0);
        // A module loaded in the call.
        assert_eq!(late_ns(60_400, 200), 60_000);
        // Not calibrated: nothing is late.
        assert_eq!(late_ns(60_400, u64::MAX), 0);
    }

    #[test]
    fn a_context_is_claimed_once() {
        let overheads = Overheads::default();
        assert!(overheads.claim(7));
        assert!(!overheads.claim(7));
        assert!(overheads.claim(8));
        // Not measured: nothing is late, and nothing is taken off.
        assert_eq!(overheads.of(Some(100), false, 60_000), (100, 0));
        assert_eq!(overheads.of(None, true, 60_000), (0, 0));
        assert_eq!(overheads.kernel_figures(), (0, 0, 0));
    }
}
