//! Pods left out: their region could not be opened or made (a squat the
//! daemon may not remove, a full `/dev/shm`). Each is tried again from the
//! periodic tick ([`Scheduler::tick`]), first [`RETRY_FIRST`] after it
//! failed, then at doubling intervals up to [`RETRY_MAX`], until it is
//! served or no longer configured: the squat's going is enough, no reload.
//! A failure is logged when the pod is first left out and when the reason
//! changes, not at every try.

use std::time::{Duration, Instant};

use super::*;

/// The wait before a pod left out is first tried again.
pub(crate) const RETRY_FIRST: Duration = Duration::from_millis(100);

/// The longest wait between two tries of a pod left out.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(1);

/// A pod whose region could not be opened.
#[derive(Debug)]
pub(crate) struct LeftOut {
    spec: PodSpec,
    /// Why, as logged: a try that fails the same way logs nothing.
    reason: String,
    /// Tries so far.
    tries: u32,
    next_try: Instant,
    /// The wait after the next try, if it fails too.
    backoff: Duration,
}

impl LeftOut {
    /// Left out after a first failed try at `now`.
    fn new(spec: PodSpec, reason: String, now: Instant) -> Self {
        Self {
            spec,
            reason,
            tries: 1,
            next_try: now + RETRY_FIRST,
            backoff: (RETRY_FIRST * 2).min(RETRY_MAX),
        }
    }

    /// Another failed try at `now`; returns whether the reason changed
    /// (then the waits start again from the first).
    fn failed_again(&mut self, spec: PodSpec, reason: String, now: Instant) -> bool {
        self.spec = spec;
        self.tries = self.tries.saturating_add(1);
        let changed = reason != self.reason;
        if changed {
            self.reason = reason;
            self.backoff = RETRY_FIRST;
        }
        self.next_try = now + self.backoff;
        self.backoff = (self.backoff * 2).min(RETRY_MAX);
        changed
    }

    fn is_due(&self, now: Instant) -> bool {
        self.next_try <= now
    }
}

impl Scheduler {
    /// Tries to open `spec`'s region now; on failure leaves the pod out
    /// (logged if it was not, or for another reason) and returns why.
    pub(super) fn open_or_leave_out(&mut self, spec: PodSpec, now: Instant) -> Result<(), String> {
        let id = spec.id.to_string();
        let Err(error) = self.open_pod(spec.clone(), now) else {
            if let Some(was) = self.failed.remove(&id) {
                tracing::info!(pod = %id, tries = was.tries.saturating_add(1), "pod served after being left out");
            }
            return Ok(());
        };
        let reason = error.to_string();
        match self.failed.get_mut(&id) {
            Some(left) => {
                if left.failed_again(spec, reason.clone(), now) {
                    tracing::warn!(pod = %id, error = %reason, "pod still left out, now for another reason");
                }
            }
            None => {
                tracing::error!(pod = %id, error = %reason, "pod left out; tried again at least every {RETRY_MAX:?} until served");
                self.failed
                    .insert(id, LeftOut::new(spec, reason.clone(), now));
            }
        }
        Err(reason)
    }

    /// Tries again the pods left out whose turn has come; returns those
    /// now served.
    pub(super) fn retry_due(&mut self, now: Instant) -> Vec<String> {
        let due: Vec<PodSpec> = self
            .failed
            .values()
            .filter(|left| left.is_due(now))
            .map(|left| left.spec.clone())
            .collect();
        let mut served = Vec::new();
        for spec in due {
            let id = spec.id.to_string();
            if self.open_or_leave_out(spec, now).is_ok() {
                served.push(id);
            }
        }
        served
    }
}

#[cfg(test)]
mod tests {
    use gpushare_utils::pod::PodId;

    use super::*;
    use crate::spec::Token;

    fn spec() -> PodSpec {
        let id = PodId::new("left").expect("pod id");
        PodSpec::new(id, Token::new("t").expect("token"), Vec::new()).expect("spec")
    }

    #[test]
    fn tries_wait_longer_up_to_the_most_and_start_over_for_a_new_reason() {
        let start = Instant::now();
        let mut left = LeftOut::new(spec(), "squat".into(), start);
        let mut waits = vec![left.next_try - start];
        let mut now = start;
        for _ in 0..5 {
            now = left.next_try;
            assert!(left.is_due(now) && !left.is_due(now - Duration::from_millis(1)));
            assert!(
                !left.failed_again(spec(), "squat".into(), now),
                "same reason: not logged"
            );
            waits.push(left.next_try - now);
        }
        assert_eq!(
            waits,
            [100, 200, 400, 800, 1000, 1000].map(Duration::from_millis)
        );
        assert!(
            left.failed_again(spec(), "full".into(), now),
            "new reason: logged"
        );
        assert_eq!(left.next_try - now, RETRY_FIRST);
        assert_eq!(left.tries, 7);
    }
}
