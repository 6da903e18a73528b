//! Sub-millisecond async sleeps for admission waits.
//!
//! Tokio's timer wheel has a resolution of one millisecond: a 100 µs sleep
//! there lasts about a millisecond, which alone would spend half of the
//! admission latency budget. One thread of our own keeps the deadlines in a
//! heap and sleeps on a condition variable until the earliest (the kernel
//! wakes it within its timer slack, about 50 µs), then completes the waiting
//! futures. No busy loop, on the runtime or off it.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

struct Waiter {
    deadline: Instant,
    seq: u64,
    wake: oneshot::Sender<()>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == CmpOrdering::Equal
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    // Reversed: the heap's top is the earliest deadline.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        (other.deadline, other.seq).cmp(&(self.deadline, self.seq))
    }
}

#[derive(Default)]
struct State {
    heap: BinaryHeap<Waiter>,
    seq: u64,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The timer thread and its queue; stopping happens on drop.
pub struct PreciseTimer {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl PreciseTimer {
    /// Starts the timer thread. Without it (spawn failed), sleeps fall back to
    /// tokio's timer.
    pub fn new() -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        });
        let thread = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("hv-timer".into())
                .spawn(move || run(&shared))
        };
        let thread = match thread {
            Ok(thread) => Some(thread),
            Err(error) => {
                tracing::warn!(%error, "no timer thread; admission waits use tokio's 1 ms timer");
                None
            }
        };
        Self { shared, thread }
    }

    /// Completes at `deadline` (within tens of microseconds).
    pub async fn sleep_until(&self, deadline: Instant) {
        if self.thread.is_none() {
            tokio::time::sleep_until(deadline.into()).await;
            return;
        }
        let (wake, woken) = oneshot::channel();
        {
            let mut state = self.shared.lock();
            let earliest = state.heap.peek().is_none_or(|top| deadline < top.deadline);
            state.seq += 1;
            let seq = state.seq;
            state.heap.push(Waiter {
                deadline,
                seq,
                wake,
            });
            if earliest {
                self.shared.changed.notify_one();
            }
        }
        // An error means the timer stopped: the wait is over either way.
        let _stopped = woken.await;
    }
}

impl Default for PreciseTimer {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for PreciseTimer {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.changed.notify_one();
        if let Some(thread) = self.thread.take()
            && thread.join().is_err()
        {
            tracing::error!("timer thread panicked");
        }
    }
}

fn run(shared: &Shared) {
    let mut state = shared.lock();
    loop {
        if state.stop {
            // Dropping the senders ends every wait.
            state.heap.clear();
            return;
        }
        let now = Instant::now();
        while state.heap.peek().is_some_and(|top| top.deadline <= now) {
            if let Some(waiter) = state.heap.pop() {
                // The waiting future may be gone (request cancelled): fine.
                let _gone = waiter.wake.send(());
            }
        }
        let wait = state
            .heap
            .peek()
            .map_or(Duration::from_secs(1), |top| top.deadline - now);
        state = shared
            .changed
            .wait_timeout(state, wait)
            .unwrap_or_else(PoisonError::into_inner)
            .0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every sleep lasts at least until its deadline, also when a later one
    /// was queued first. Only lower bounds: how far past the deadline a
    /// sleep ends depends on the machine's load; it is printed, not asserted.
    #[test]
    fn sleeps_last_until_their_deadlines() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let timer = PreciseTimer::new();
        rt.block_on(async {
            let mut worst = Duration::ZERO;
            for _ in 0..50 {
                let start = Instant::now();
                timer.sleep_until(start + Duration::from_micros(100)).await;
                let took = start.elapsed();
                assert!(took >= Duration::from_micros(100));
                worst = worst.max(took);
            }
            // On an idle machine far below tokio's millisecond.
            eprintln!("worst 100 µs sleep: {worst:?}");
            let start = Instant::now();
            let (late, early) = tokio::join!(
                async {
                    timer.sleep_until(start + Duration::from_millis(3)).await;
                    start.elapsed()
                },
                async {
                    timer.sleep_until(start + Duration::from_millis(1)).await;
                    start.elapsed()
                },
            );
            // Waking the earlier deadline does not end the later one with it.
            assert!(late >= Duration::from_millis(3), "{late:?}");
            assert!(early >= Duration::from_millis(1), "{early:?}");
        });
    }
}
