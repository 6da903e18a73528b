//! Each pod's uses of its GPUs, as the daemon sees them by sampling the
//! pod's last-call stamp: a use is a run of calls, and a stamp more than
//! [`CORRELATED_MS`] after the last one seen begins a new use (the calls
//! of one request count once, however many samples see them). The policy
//! ranks idle pods by the end of their use before the last (LRU-2), and
//! leaves a pod just brought back resident for a while; both come from
//! here.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Calls this close to the last one seen belong to the same use.
pub const CORRELATED_MS: u64 = 500;

/// What the daemon saw of one pod's uses, `CLOCK_MONOTONIC` milliseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodUses {
    /// The last call seen (0: none).
    pub last_ms: u64,
    /// The last call of the use before the one `last_ms` is in (0: none).
    pub previous_ms: u64,
    /// When the daemon last brought the pod back (0: not in this run).
    pub back_ms: u64,
}

impl PodUses {
    /// A call stamped `stamp_ms`, sampled at `now_ms`: a use of its own,
    /// or of the last one, by [`Self::previous_to`]; a stamp of none yet,
    /// from the future (forged) or older than the last one seen changes
    /// nothing.
    fn saw(&mut self, stamp_ms: u64, now_ms: u64) {
        if stamp_ms != 0 && stamp_ms <= now_ms && stamp_ms > self.last_ms {
            self.previous_ms = self.previous_to(stamp_ms);
            self.last_ms = stamp_ms;
        }
    }

    /// The end of the use before the one a call stamped `stamp_ms` is in:
    /// a stamp newer than the samples saw that begins a use of its own
    /// makes the last use seen the one before.
    pub fn previous_to(&self, stamp_ms: u64) -> u64 {
        if self.last_ms != 0 && stamp_ms > self.last_ms.saturating_add(CORRELATED_MS) {
            self.last_ms
        } else {
            self.previous_ms
        }
    }
}

/// Every pod's uses.
#[derive(Debug, Default)]
pub struct Uses {
    pods: Mutex<BTreeMap<String, PodUses>>,
}

impl Uses {
    /// The pod's last call was stamped `stamp_ms`, sampled at `now_ms`; a
    /// stamp of none yet, from the future (forged) or older than the last
    /// one seen changes nothing.
    pub fn observe(&self, pod: &str, stamp_ms: u64, now_ms: u64) {
        let mut pods = self.lock();
        pods.entry(pod.to_owned())
            .or_default()
            .saw(stamp_ms, now_ms);
    }

    /// The daemon brought the pod back at `now_ms`. Where a call of the
    /// pod, stamped `waiting_ms`, asked for it, that call's use runs on
    /// through its wait: the calls after it are of the same use however
    /// long the swap-in and the swaps queued before it took, not a second
    /// use that would make the pod look called twice.
    pub fn brought_back(&self, pod: &str, now_ms: u64, waiting_ms: Option<u64>) {
        let mut pods = self.lock();
        let uses = pods.entry(pod.to_owned()).or_default();
        uses.back_ms = now_ms;
        let Some(stamp) = waiting_ms else {
            return;
        };
        uses.saw(stamp, now_ms);
        if uses.last_ms != 0 {
            uses.last_ms = uses.last_ms.max(now_ms);
        }
    }

    /// What was seen of the pod (nothing: all zero).
    pub fn of(&self, pod: &str) -> PodUses {
        self.lock().get(pod).copied().unwrap_or_default()
    }

    /// Forgets every pod `keep` does not keep (those no longer scheduled).
    pub fn retain(&self, keep: impl Fn(&str) -> bool) {
        self.lock().retain(|pod, _| keep(pod));
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, PodUses>> {
        // Every update is one step: a panic elsewhere leaves it usable.
        self.pods.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn calls_close_together_are_one_use_and_a_later_one_begins_another() {
        let uses = Uses::default();
        for stamp in [1_000, 1_100, 1_400] {
            uses.observe("p", stamp, stamp + 50);
        }
        assert_eq!(
            uses.of("p"),
            PodUses {
                last_ms: 1_400,
                previous_ms: 0,
                back_ms: 0
            }
        );
        uses.observe("p", 3_000, 3_050);
        uses.observe("p", 3_200, 3_250);
        assert_eq!(
            (uses.of("p").previous_ms, uses.of("p").last_ms),
            (1_400, 3_200)
        );
        uses.observe("p", 9_000, 9_000);
        assert_eq!(uses.of("p").previous_ms, 3_200);
    }

    #[test]
    fn a_call_the_samples_missed_counts_as_a_use_of_its_own() {
        let uses = Uses::default();
        uses.observe("p", 1_000, 1_000);
        let seen = uses.of("p");
        assert_eq!(seen.previous_to(1_200), 0, "the same use");
        assert_eq!(seen.previous_to(5_000), 1_000, "a new use");
    }

    #[test]
    fn forged_stale_and_absent_stamps_change_nothing() {
        let uses = Uses::default();
        uses.observe("p", 2_000, 2_000);
        uses.observe("p", 0, 5_000);
        uses.observe("p", 99_000, 5_000);
        uses.observe("p", 1_000, 5_000);
        assert_eq!(uses.of("p").last_ms, 2_000);
        assert_eq!(uses.of("p").previous_ms, 0);
    }

    #[test]
    fn a_call_that_waited_for_its_pod_is_one_use_with_the_calls_after_it() {
        let uses = Uses::default();
        uses.observe("p", 1_000, 1_000);
        // Its call at 5,000 waits 900 ms for the pod (unsampled), and
        // the calls after it are of that use.
        uses.brought_back("p", 5_900, Some(5_000));
        uses.observe("p", 6_000, 6_050);
        uses.observe("p", 6_300, 6_350);
        assert_eq!(uses.of("p").previous_ms, 1_000);
        assert_eq!(uses.of("p").previous_to(6_300), 1_000);
        // Brought back with no call waiting (an operator's swap-in): the
        // next call is a use of its own, and the one before is the last
        // call seen.
        let uses = Uses::default();
        uses.observe("q", 1_000, 1_000);
        uses.brought_back("q", 5_900, None);
        uses.observe("q", 6_000, 6_050);
        assert_eq!(uses.of("q").previous_ms, 1_000);
        assert_eq!(uses.of("q").last_ms, 6_000);
        // Without the wait counted, two uses: 5,000 and 6,000.
        let uses = Uses::default();
        uses.observe("r", 1_000, 1_000);
        uses.observe("r", 5_000, 5_000);
        uses.observe("r", 6_000, 6_050);
        assert_eq!(uses.of("r").previous_ms, 5_000);
    }

    #[test]
    fn a_pod_brought_back_is_recorded_and_a_gone_pod_forgotten() {
        let uses = Uses::default();
        uses.brought_back("p", 7_000, None);
        uses.observe("q", 1_000, 1_000);
        assert_eq!(uses.of("p").back_ms, 7_000);
        uses.retain(|pod| pod == "q");
        assert_eq!(uses.of("p"), PodUses::default());
        assert_eq!(uses.of("q").last_ms, 1_000);
    }
}
