//! The gate of a batch launch: from its device's latency line in the node's
//! priority table, whether it goes, goes with its work in flight bounded, or
//! waits for a latency pod (active, or about to be).

use gpushare_utils::priority::{LatencyView, STALL_NS};

/// Default of how long after a latency pod's last launch, or its last work
/// seen in flight, batch launches on its GPU are held: longer than the host
/// gaps between the launches of one request (tens of µs in PyTorch).
pub(super) const DEFAULT_HOLD_NS: u64 = 100_000;
/// A latency pod whose heartbeat is this recent is on the GPU: batch pods
/// there keep their in-flight work bounded even while it is idle, so that its
/// next request finds at most that much in front of it.
pub(super) const PRESENT_WINDOW_NS: u64 = 100_000_000;

/// A batch launch held this long goes through anyway: a latency pod that is
/// never idle slows batch pods to a trickle but never stops them.
pub(super) const STARVATION_NS: u64 = 100_000_000;

/// A batch kernel launched under a prediction must be done this long before
/// the predicted arrival (the latency pod's host-side jitter, the launch).
pub(super) const PREDICT_MARGIN_NS: u64 = 20_000;
/// Prediction holds batch launches only while their kernels last at most
/// `period / PREDICT_KERNEL_SHARE`: longer ones would cost the batch pod
/// a large share of each period for little gain.
pub(super) const PREDICT_KERNEL_SHARE: u64 = 5;

/// What a batch launch does, from its device's latency line ([`LatencyView`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Gate {
    /// No latency pod on the device: launch as usual.
    Free,
    /// A latency pod is on the device but idle: launch, keeping the pod's
    /// work in flight bounded.
    Bounded,
    /// A latency pod is active: wait.
    Hold,
    /// A latency pod is idle, but its next request is due before a batch
    /// kernel launched now would be done: wait (bounded like [`Gate::Hold`]).
    Predicted,
}

/// The gate for a batch launch at `now` given its device's latency line
/// (as [`NodePriority::latency`] reads it: only what may be believed, all
/// zero for a table whose header is wrong), with hold window `hold_ns`;
/// `kernel_ns`: how long the batch thread's launches take to complete (0:
/// unknown, no prediction).
///
/// [`NodePriority::latency`]: gpushare_utils::priority::NodePriority::latency
pub(super) fn gate(line: LatencyView, now_ns: u64, hold_ns: u64, kernel_ns: u64) -> Gate {
    let LatencyView {
        active_at_ns,
        in_flight,
        present_at_ns,
        ..
    } = line;
    // A stamp a little ahead of `now` (another process read the clock later)
    // counts as now; one further ahead than the slack was dropped as garbage.
    let since = now_ns.saturating_sub(active_at_ns);
    if active_at_ns != 0 && (since < hold_ns || (in_flight > 0 && since < STALL_NS)) {
        Gate::Hold
    } else if present_at_ns != 0 && now_ns.saturating_sub(present_at_ns) < PRESENT_WINDOW_NS {
        if predicted(line, now_ns, hold_ns, kernel_ns) {
            Gate::Predicted
        } else {
            Gate::Bounded
        }
    } else {
        Gate::Free
    }
}

/// Whether a batch kernel of `kernel_ns` launched at `now` could still run
/// when the latency pod's predicted request arrives: from `kernel_ns` plus
/// [`PREDICT_MARGIN_NS`] before the arrival until `hold_ns` after it (a late
/// request), never past half a period after it (a stale prediction: a
/// latency pod that stopped holds nobody).
fn predicted(line: LatencyView, now_ns: u64, hold_ns: u64, kernel_ns: u64) -> bool {
    let (next, period) = (line.next_arrival_ns, line.period_ns);
    if next == 0 || period == 0 || kernel_ns == 0 || kernel_ns > period / PREDICT_KERNEL_SHARE {
        return false;
    }
    let opens = next.saturating_sub(kernel_ns.saturating_add(PREDICT_MARGIN_NS));
    let closes = next.saturating_add(hold_ns.min(period / 2));
    (opens..closes).contains(&now_ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: u64 = 1_000;
    const MS: u64 = 1_000_000;

    #[test]
    fn the_gate_holds_within_the_window_and_bounds_while_present() {
        let hold = DEFAULT_HOLD_NS;
        let now = 10_000 * MS;
        // (active_at, in_flight, present_at, expected)
        let table: &[(u64, u64, u64, Gate)] = &[
            (0, 0, 0, Gate::Free),
            (0, 1, now, Gate::Bounded),
            (now - 50 * US, 0, now - MS, Gate::Hold),
            (now + 5 * US, 0, 0, Gate::Hold),
            (now - hold, 0, now - MS, Gate::Bounded),
            (now - hold - 1, 0, 0, Gate::Free),
            (now - 10 * MS, 1, now, Gate::Hold),
            (now - STALL_NS + 1, 2, now, Gate::Hold),
            (now - STALL_NS, 1, now, Gate::Bounded),
            (now - 10 * MS, 0, now - PRESENT_WINDOW_NS + 1, Gate::Bounded),
            (now - 10 * MS, 0, now - PRESENT_WINDOW_NS, Gate::Free),
        ];
        for &(active_at_ns, in_flight, present_at_ns, want) in table {
            let view = LatencyView {
                active_at_ns,
                in_flight,
                present_at_ns,
                ..LatencyView::default()
            };
            assert_eq!(gate(view, now, hold, 200 * US), want, "{view:?}");
        }
    }

    #[test]
    fn the_gate_holds_before_a_predicted_arrival() {
        let (hold, period, kernel) = (DEFAULT_HOLD_NS, 2 * MS, 200 * US);
        let next = 10_000 * MS;
        let opens = next - kernel - PREDICT_MARGIN_NS;
        let view = LatencyView {
            active_at_ns: next - period + 300 * US,
            present_at_ns: next - 5 * MS,
            next_arrival_ns: next,
            period_ns: period,
            ..LatencyView::default()
        };
        // (now, batch kernel, expected)
        let table: &[(u64, u64, Gate)] = &[
            (opens - 1, kernel, Gate::Bounded),
            (opens, kernel, Gate::Predicted),
            (next - 1, kernel, Gate::Predicted),
            (next + hold - 1, kernel, Gate::Predicted),
            // A late request is waited for no longer than the hold.
            (next + hold, kernel, Gate::Bounded),
            // No estimate of the batch kernel yet: no prediction.
            (next - 10 * US, 0, Gate::Bounded),
            // Kernels longer than a fifth of the period: not worth holding.
            (
                next - 10 * US,
                period / PREDICT_KERNEL_SHARE + 1,
                Gate::Bounded,
            ),
            (
                next - 10 * US,
                period / PREDICT_KERNEL_SHARE,
                Gate::Predicted,
            ),
        ];
        for &(now, kernel_ns, want) in table {
            assert_eq!(
                gate(view, now, hold, kernel_ns),
                want,
                "at {now} kernel {kernel_ns}"
            );
        }
        // Without a period, with no latency pod present, or while it is
        // active, prediction does not decide.
        let none = LatencyView {
            period_ns: 0,
            ..view
        };
        assert_eq!(gate(none, next - 10 * US, hold, kernel), Gate::Bounded);
        let gone = LatencyView {
            present_at_ns: 0,
            ..view
        };
        assert_eq!(gate(gone, next - 10 * US, hold, kernel), Gate::Free);
        let active = LatencyView {
            active_at_ns: next - 20 * US,
            ..view
        };
        assert_eq!(gate(active, next - 10 * US, hold, kernel), Gate::Hold);
        // A stale prediction holds nobody, even with a long hold window.
        let (long_hold, quiet) = (
            5 * MS,
            LatencyView {
                active_at_ns: next - 10 * MS,
                ..view
            },
        );
        assert_eq!(
            gate(quiet, next + period / 2 - 1, long_hold, kernel),
            Gate::Predicted
        );
        assert_eq!(
            gate(quiet, next + period / 2, long_hold, kernel),
            Gate::Bounded
        );
    }
}
