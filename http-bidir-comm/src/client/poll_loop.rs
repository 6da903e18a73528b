//! The loop a [`Client`] runs on its own thread: hello, long-poll, run the
//! handler, post the result; reconnect with backoff.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::wire::{ClientId, Task, TaskId};

use super::*;

impl Client {
    /// Runs the client on its own thread: hello, then long-poll; each task goes
    /// to `handler` and its return value is posted as the result. When the hub
    /// is away, it retries with jittered exponential backoff and says hello
    /// again once back (also when the hub restarted between two polls, seen
    /// from its instance id). A handler that panics gets no result posted; the
    /// loop goes on. A task that does not decode as `T` is skipped (logged).
    ///
    /// The loop has its own connections, so stopping it does not affect this
    /// client.
    pub fn spawn_loop<T, R, F>(&self, handler: F) -> Result<LoopHandle, ChannelError>
    where
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: FnMut(Task<T>) -> R + Send + 'static,
    {
        let client = Self {
            inner: Arc::new(Inner {
                agent: build_agent(&self.inner.opts, self.inner.base.socket.as_deref()),
                base: self.inner.base.clone(),
                id: self.inner.id.clone(),
                auth: self.inner.auth.clone(),
                opts: self.inner.opts.clone(),
                metadata: Arc::clone(&self.inner.metadata),
            }),
        };
        let agent = client.inner.agent.clone();
        let stop = Arc::new(StopSignal::default());
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let join = thread::Builder::new()
            .name("bidir-client".to_owned())
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    // Dropped when the thread ends, however it ends: that is the
                    // "done" signal stop() waits for.
                    let _done = done_tx;
                    let run = catch_unwind(AssertUnwindSafe(|| run_loop(&client, &stop, handler)));
                    if run.is_err() {
                        tracing::error!(client = %client.inner.id, "client loop panicked; stopped");
                    }
                }
            })
            .map_err(ChannelError::Spawn)?;
        Ok(LoopHandle {
            stop,
            agent: Some(agent),
            join: Some(join),
            done: done_rx,
            stop_timeout: self.inner.opts.stop_timeout,
            detached: false,
        })
    }
}

/// Handle of a loop started by [`Client::spawn_loop`]. Dropping it asks the
/// loop to stop without waiting; [`LoopHandle::detach`] leaves it running.
#[derive(Debug)]
pub struct LoopHandle {
    pub(super) stop: Arc<StopSignal>,
    pub(super) agent: Option<ureq::Agent>,
    pub(super) join: Option<JoinHandle<()>>,
    pub(super) done: mpsc::Receiver<()>,
    pub(super) stop_timeout: Duration,
    pub(super) detached: bool,
}

impl LoopHandle {
    /// Stops the loop and joins its thread, waiting at most
    /// [`ClientOptions::stop_timeout`]. A long-poll or request in progress is
    /// cut short at once; a handler call in progress is waited for.
    pub fn stop(self) -> Result<(), ChannelError> {
        let limit = self.stop_timeout;
        self.stop_within(limit)
    }

    /// [`LoopHandle::stop`] with an explicit limit. Past it the thread is left
    /// detached (it ends by itself once its current call returns) and
    /// [`ChannelError::StopTimeout`] is returned.
    pub fn stop_within(mut self, limit: Duration) -> Result<(), ChannelError> {
        self.signal();
        match self.done.recv_timeout(limit) {
            Err(RecvTimeoutError::Timeout) => {
                self.join.take();
                Err(ChannelError::StopTimeout(limit))
            }
            Ok(()) | Err(RecvTimeoutError::Disconnected) => match self.join.take() {
                Some(join) => join.join().map_err(|_| ChannelError::LoopPanicked),
                None => Ok(()),
            },
        }
    }

    /// Whether the loop thread has ended.
    pub fn is_finished(&self) -> bool {
        self.join.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Lets the loop run for the rest of the process, without a handle.
    pub fn detach(mut self) {
        self.detached = true;
    }

    fn signal(&mut self) {
        self.stop.set();
        if let Some(agent) = self.agent.take() {
            // Interrupts a blocked read or write on the loop's sockets.
            agent.shutdown();
        }
    }
}

impl Drop for LoopHandle {
    fn drop(&mut self) {
        if !self.detached {
            self.signal();
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct StopSignal {
    pub(super) stopped: Mutex<bool>,
    pub(super) cv: Condvar,
}

impl StopSignal {
    pub(super) fn set(&self) {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }

    pub(super) fn is_set(&self) -> bool {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sleeps up to `d`; true as soon as the stop is set.
    pub(super) fn wait(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut stopped = self.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        while !*stopped {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            stopped = self
                .cv
                .wait_timeout(stopped, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *stopped
    }
}

pub(super) fn run_loop<T, R, F>(client: &Client, stop: &StopSignal, mut handler: F)
where
    T: DeserializeOwned,
    R: Serialize,
    F: FnMut(Task<T>) -> R,
{
    let opts = &client.inner.opts;
    let mut backoff = Backoff::new(opts.backoff_min, opts.backoff_max, seed(&client.inner.id));
    let mut outage = OutageLog::default();
    let mut hello_instance: Option<String> = None;
    let mut need_hello = true;
    while !stop.is_set() {
        if need_hello {
            match client.send_hello(&client.metadata()) {
                Ok(reply) => {
                    need_hello = false;
                    hello_instance = Some(reply.instance);
                    backoff.reset();
                    outage.up(&client.inner.id);
                }
                Err(e) => {
                    outage.down(&client.inner.id, "hello", &e, stop);
                    if stop.wait(backoff.next_delay()) {
                        break;
                    }
                    continue;
                }
            }
        }
        let (tasks, instance) = match client.fetch(opts.long_poll_wait) {
            Ok(got) => got,
            Err(e) => {
                outage.down(&client.inner.id, "poll", &e, stop);
                need_hello = true;
                if stop.wait(backoff.next_delay()) {
                    break;
                }
                continue;
            }
        };
        backoff.reset();
        if instance.is_some() && instance != hello_instance {
            tracing::info!(client = %client.inner.id, "hub restarted; saying hello again");
            need_hello = true;
        }
        for raw in tasks {
            if stop.is_set() {
                break;
            }
            let id = raw.id;
            let task = match serde_json::from_value::<T>(raw.task) {
                Ok(task) => task,
                Err(e) => {
                    tracing::warn!(client = %client.inner.id, task = %id, error = %e, "task does not decode; skipped");
                    continue;
                }
            };
            let Ok(result) = catch_unwind(AssertUnwindSafe(|| handler(Task { id, task }))) else {
                tracing::error!(client = %client.inner.id, task = %id, "task handler panicked; no result posted");
                continue;
            };
            if !deliver(client, stop, &mut backoff, id, &result) {
                need_hello = true;
            }
        }
    }
}

/// Posts one result, retrying while the hub is away (a few times, with
/// backoff). False if it could not be delivered.
pub(super) fn deliver<R: Serialize>(
    client: &Client,
    stop: &StopSignal,
    backoff: &mut Backoff,
    id: TaskId,
    result: &R,
) -> bool {
    const ATTEMPTS: u32 = 4;
    for attempt in 1..=ATTEMPTS {
        match client.post_result(id, result) {
            Ok(()) => return true,
            Err(e) if e.is_retryable() && attempt < ATTEMPTS && !stop.is_set() => {
                tracing::debug!(client = %client.inner.id, task = %id, error = %e, "posting result failed; retrying");
                if stop.wait(backoff.next_delay()) {
                    return false;
                }
            }
            Err(e) => {
                tracing::warn!(client = %client.inner.id, task = %id, error = %e, "result not delivered");
                return false;
            }
        }
    }
    false
}

/// Logs a lost connection once, then quietly until it is back.
#[derive(Default)]
pub(super) struct OutageLog {
    pub(super) down_since: Option<Instant>,
}

impl OutageLog {
    fn down(&mut self, id: &ClientId, what: &str, e: &ChannelError, stop: &StopSignal) {
        if stop.is_set() {
            return;
        }
        if self.down_since.is_none() {
            self.down_since = Some(Instant::now());
            tracing::warn!(client = %id, error = %e, "{what} failed; retrying with backoff");
        } else {
            tracing::debug!(client = %id, error = %e, "{what} failed again");
        }
    }

    fn up(&mut self, id: &ClientId) {
        if let Some(since) = self.down_since.take() {
            tracing::info!(client = %id, after = ?since.elapsed(), "hub reachable again");
        }
    }
}

pub(super) fn seed(id: &ClientId) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(id.as_str().as_bytes());
    h.write_u32(std::process::id());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_signal_wakes_a_sleeper() {
        let stop = Arc::new(StopSignal::default());
        let sleeper = {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let t = Instant::now();
                (stop.wait(Duration::from_secs(10)), t.elapsed())
            })
        };
        thread::sleep(Duration::from_millis(20));
        stop.set();
        let (stopped, took) = sleeper.join().unwrap();
        assert!(stopped);
        // The sleeper waits up to 10 s; ending only then is the bug. Woken,
        // it ends some 20 ms in, however loaded the machine: < 5 s.
        assert!(took < Duration::from_secs(5), "{took:?}");
    }
}
