//! The generated detour calls the original at most once per call, whatever
//! its handler does after calling it.

use crate::common;

use std::sync::atomic::{AtomicU64, Ordering};

use gpushare_hook::set_enabled;

use common::{Bypass, Status};

static CALLS: AtomicU64 = AtomicU64::new(0);

/// The "driver": counts its calls, answers x + 1.
unsafe extern "C" fn driver(x: u64) -> Status {
    CALLS.fetch_add(1, Ordering::SeqCst);
    Status(x + 1)
}

mod handlers {
    use super::*;

    pub(crate) fn panic_after(
        original: super::calls_then_panics::Signature,
        x: u64,
    ) -> Result<Status, Bypass> {
        // SAFETY: the test's own function, any argument.
        let _ = unsafe { original(x) };
        panic!("fault after the original ran");
    }

    pub(crate) fn bypass_after(
        original: super::calls_then_bypasses::Signature,
        x: u64,
    ) -> Result<Status, Bypass> {
        // SAFETY: as above.
        let _ = unsafe { original(x) };
        Err(Bypass)
    }

    pub(crate) fn panic_before(
        _original: super::panics_first::Signature,
        _x: u64,
    ) -> Result<Status, Bypass> {
        panic!("fault before the original ran");
    }
}

gpushare_macros::detours! {
    /// Test detours.
    pub static TEST_DETOURS;

    /// Calls the original, then panics.
    required fn calls_then_panics(x: u64) -> Status => handlers::panic_after;
    /// Calls the original, then asks for it again.
    required fn calls_then_bypasses(x: u64) -> Status => handlers::bypass_after;
    /// Panics before calling the original.
    required fn panics_first(x: u64) -> Status => handlers::panic_before;
}

#[test]
fn the_original_runs_exactly_once_per_call() {
    for entry in &TEST_DETOURS {
        entry
            .original
            .store(driver as *const () as usize, Ordering::Release);
    }
    set_enabled(true);
    let cases: [(&str, unsafe extern "C" fn(u64) -> Status); 3] = [
        ("panic after the call", calls_then_panics::detour),
        ("bypass after the call", calls_then_bypasses::detour),
        ("panic before the call", panics_first::detour),
    ];
    for (case, detour) in cases {
        for x in [1u64, 41] {
            let before = CALLS.load(Ordering::SeqCst);
            // SAFETY: the generated detour of a test function.
            let result = unsafe { detour(x) };
            assert_eq!(result, Status(x + 1), "{case}: the original's result");
            assert_eq!(
                CALLS.load(Ordering::SeqCst) - before,
                1,
                "{case}: one call of the original"
            );
        }
    }
}
