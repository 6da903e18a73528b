//! Waiting for what a test expects to come true: polled, with a deadline
//! generous enough for a loaded machine.

use std::time::{Duration, Instant};

/// Polls `done` every 20 ms for `within`; whether it came true.
pub fn wait_for(within: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    done()
}

/// Waits up to 10 s for `ok`; panics naming `what` when it never holds.
pub fn eventually(what: &str, ok: impl FnMut() -> bool) {
    assert!(wait_for(Duration::from_secs(10), ok), "never: {what}");
}
