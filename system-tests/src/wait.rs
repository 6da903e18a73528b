//! Waiting for what a test expects to come true: polled, with a deadline
//! generous enough for a loaded machine and for Kubernetes' scheduler and
//! controllers, which act on their own time. The deadline only bounds how
//! long a failing test takes to say so.

use std::time::{Duration, Instant};

/// How long the `eventually` functions wait.
pub const PATIENCE: Duration = Duration::from_secs(90);

/// How often they look.
const POLL: Duration = Duration::from_millis(20);

/// Polls `done` every 20 ms for `within`; whether it came true.
pub fn wait_for(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(POLL);
    }
    done()
}

/// Waits for `done`; panics naming `what` when it never holds.
pub fn eventually(what: &str, done: impl FnMut() -> bool) {
    assert!(wait_for(PATIENCE, done), "never: {what}");
}

/// Waits for `check` to give a value, and returns it; panics naming `what`
/// when it never does.
pub fn eventually_some<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(found) = check() {
            return found;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(POLL);
    }
}

/// [`eventually`] in a test that runs on a Tokio runtime: sleeps without
/// holding up the runtime's other tasks.
#[cfg(feature = "node")]
pub async fn eventually_async(what: &str, mut done: impl FnMut() -> bool) {
    eventually_some_async(what, || std::future::ready(done().then_some(()))).await;
}

/// [`eventually_some`] in a test that runs on a Tokio runtime, with a check
/// that may await (a request to the API server).
#[cfg(feature = "node")]
pub async fn eventually_some_async<T, F>(what: &str, mut check: impl FnMut() -> F) -> T
where
    F: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Some(found) = check().await {
            return found;
        }
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(POLL).await;
    }
}
