//! An `around` handler decides before the call; the detour calls the
//! original once, with the caller's arguments, hands the result to
//! what the handler returned, and returns it, whatever the handler does;
//! with `again`, it calls the original once more while `again` asks.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};

use gpushare_hook::{AfterCall, Disposition, IntoReturn, set_enabled};

use common::Status;

/// A handler's refusal, or its request for the original.
pub(crate) enum Refusal {
    /// Call the original.
    Bypass,
    /// Refuse the call without the original.
    Refuse,
}

impl IntoReturn<Status> for Refusal {
    fn into_return(self) -> Disposition<Status> {
        match self {
            Self::Bypass => Disposition::CallOriginal,
            Self::Refuse => Disposition::Return(Status(999)),
        }
    }
}

static CALLS: AtomicU64 = AtomicU64::new(0);
/// What the last `after` saw: the argument the handler admitted and the
/// original's result.
static SEEN: AtomicU64 = AtomicU64::new(0);

/// The "driver": counts its calls, answers x + 1.
unsafe extern "C" fn driver(x: u64) -> Status {
    CALLS.fetch_add(1, Ordering::SeqCst);
    Status(x + 1)
}

/// What a handler admitted: `x`, and whether to panic once the call is made.
pub(crate) struct Admitted {
    x: u64,
    panic: bool,
}

impl AfterCall<Status> for Admitted {
    fn after(self, result: Status) {
        SEEN.store(self.x * 1000 + result.0, Ordering::SeqCst);
        assert!(!self.panic, "fault after the original ran");
    }
}

mod handlers {
    use super::*;

    pub(crate) fn admit(x: u64) -> Result<Admitted, Refusal> {
        Ok(Admitted { x, panic: false })
    }

    pub(crate) fn admit_then_panic(x: u64) -> Result<Admitted, Refusal> {
        Ok(Admitted { x, panic: true })
    }

    pub(crate) fn bypass(_x: u64) -> Result<Admitted, Refusal> {
        Err(Refusal::Bypass)
    }

    pub(crate) fn refuse(_x: u64) -> Result<Admitted, Refusal> {
        Err(Refusal::Refuse)
    }

    pub(crate) fn panic_before(_x: u64) -> Result<Admitted, Refusal> {
        panic!("fault before the original ran");
    }
}

gpushare_macros::detours! {
    /// Test detours.
    pub static AROUND_DETOURS;

    /// Admits the call.
    required fn admits(x: u64) -> Status => around handlers::admit;
    /// Admits the call, then panics once it returned.
    required fn panics_after(x: u64) -> Status => around handlers::admit_then_panic;
    /// Asks for the original.
    required fn bypasses(x: u64) -> Status => around handlers::bypass;
    /// Refuses the call.
    required fn refuses(x: u64) -> Status => around handlers::refuse;
    /// Panics before the call.
    required fn panics_before(x: u64) -> Status => around handlers::panic_before;
}

/// Calls `detour` with `x`: its result and how many times the original ran.
fn call(detour: unsafe extern "C" fn(u64) -> Status, x: u64) -> (Status, u64) {
    let before = CALLS.load(Ordering::SeqCst);
    // SAFETY: the generated detour of a test function.
    let result = unsafe { detour(x) };
    (result, CALLS.load(Ordering::SeqCst) - before)
}

#[test]
fn the_detour_calls_the_original_once_and_hands_the_result_after() {
    for entry in &AROUND_DETOURS {
        entry
            .original
            .store(driver as *const () as usize, Ordering::Release);
    }
    set_enabled(true);
    for x in [1u64, 41] {
        assert_eq!(call(admits::detour, x), (Status(x + 1), 1), "admitted");
        assert_eq!(
            SEEN.load(Ordering::SeqCst),
            x * 1000 + x + 1,
            "after saw what was admitted and the original's result"
        );
        SEEN.store(0, Ordering::SeqCst);
        assert_eq!(
            call(panics_after::detour, x),
            (Status(x + 1), 1),
            "a panic after the call returns the original's result"
        );
        assert_eq!(SEEN.load(Ordering::SeqCst), x * 1000 + x + 1);
        SEEN.store(0, Ordering::SeqCst);
        assert_eq!(call(bypasses::detour, x), (Status(x + 1), 1), "bypassed");
        assert_eq!(call(refuses::detour, x), (Status(999), 0), "refused");
        assert_eq!(
            call(panics_before::detour, x),
            (Status(x + 1), 1),
            "a panic before the call falls back to the original"
        );
        assert_eq!(
            SEEN.load(Ordering::SeqCst),
            0,
            "after runs only when admitted"
        );
    }
}

/// Answers 0 (no room) at each call until `ROOMY` calls are made, then
/// x + 1.
static AGAIN_CALLS: AtomicU64 = AtomicU64::new(0);
static ROOMY: AtomicU64 = AtomicU64::new(0);

unsafe extern "C" fn short_of_room(x: u64) -> Status {
    let call = AGAIN_CALLS.fetch_add(1, Ordering::SeqCst) + 1;
    if call < ROOMY.load(Ordering::SeqCst) {
        Status(0)
    } else {
        Status(x + 1)
    }
}

/// What the retried detours admit: nothing to do after (the other test
/// reads what `Admitted` saw).
pub(crate) struct Quiet;

impl AfterCall<Status> for Quiet {
    fn after(self, _result: Status) {}
}

fn admit_quietly(_x: u64) -> Result<Quiet, Refusal> {
    Ok(Quiet)
}

fn bypass_quietly(_x: u64) -> Result<Quiet, Refusal> {
    Err(Refusal::Bypass)
}

/// Once more for a 0, three times at most.
fn again(result: Status, tries: u32) -> bool {
    result.0 == 0 && tries < 3
}

gpushare_macros::detours! {
    /// Test detours whose original is called again while `again` asks.
    pub static AGAIN_DETOURS;

    /// Admits the call.
    required fn admits_again(x: u64) -> Status => around admit_quietly, again again;
    /// Asks for the original.
    required fn bypasses_again(x: u64) -> Status => around bypass_quietly, again again;
}

#[test]
fn the_original_is_called_again_while_again_asks_admitted_or_bypassed() {
    for entry in &AGAIN_DETOURS {
        entry
            .original
            .store(short_of_room as *const () as usize, Ordering::Release);
    }
    set_enabled(true);
    let calls = |detour: unsafe extern "C" fn(u64) -> Status, roomy: u64| {
        ROOMY.store(roomy, Ordering::SeqCst);
        AGAIN_CALLS.store(0, Ordering::SeqCst);
        // SAFETY: the generated detour of a test function.
        let result = unsafe { detour(7) };
        (result, AGAIN_CALLS.load(Ordering::SeqCst))
    };
    for detour in [admits_again::detour, bypasses_again::detour] {
        assert_eq!(calls(detour, 0), (Status(8), 1), "once when it succeeds");
        assert_eq!(calls(detour, 3), (Status(8), 3), "until it succeeds");
        assert_eq!(calls(detour, 9), (Status(0), 4), "at most as again says");
    }
}
