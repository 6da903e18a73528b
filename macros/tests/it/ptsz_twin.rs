//! A `ptsz` declaration generates the plain detour and its `_ptsz` twin from
//! one signature: each forwards to its own original, tells its handler which
//! it is, and sits in the install table right after the other.

use crate::common;

use std::sync::atomic::Ordering;

use gpushare_hook::set_enabled;

use common::{Bypass, Status};

/// The plain "driver" entry point.
unsafe extern "C" fn plain(x: u64, y: u64) -> Status {
    Status(x + y)
}

/// Its per-thread twin.
unsafe extern "C" fn per_thread(x: u64, y: u64) -> Status {
    Status(1000 + x + y)
}

mod handlers {
    use super::*;

    /// Forwards, and marks the answer with which twin ran it.
    pub(crate) fn add<const PER_THREAD: bool>(
        original: super::add::Signature,
        x: u64,
        y: u64,
    ) -> Result<Status, Bypass> {
        // SAFETY: the test's own functions, any arguments.
        let Status(sum) = unsafe { original(x, y) };
        Ok(Status(sum * 10 + u64::from(PER_THREAD)))
    }
}

gpushare_macros::detours! {
    /// Twin detours.
    pub static TWIN_DETOURS;

    /// Adds.
    required ptsz fn add(x: u64, y: u64) -> Status => handlers::add;
}

#[test]
fn a_ptsz_declaration_makes_two_detours_with_their_own_originals() {
    assert_eq!(TWIN_DETOURS.len(), 2);
    assert_eq!(TWIN_DETOURS[0].symbol, c"add");
    assert!(TWIN_DETOURS[0].required);
    assert_eq!(TWIN_DETOURS[1].symbol, c"add_ptsz");
    assert!(!TWIN_DETOURS[1].required, "the twin is optional");
    let originals: [unsafe extern "C" fn(u64, u64) -> Status; 2] = [plain, per_thread];
    for (entry, original) in TWIN_DETOURS.iter().zip(originals) {
        entry
            .original
            .store(original as *const () as usize, Ordering::Release);
    }
    set_enabled(true);
    // SAFETY: the generated detours of test functions.
    let (first, twin) = unsafe { (add::detour(1, 2), add_ptsz::detour(1, 2)) };
    assert_eq!(first, Status(30), "the plain original, PER_THREAD = false");
    assert_eq!(
        twin,
        Status(10031),
        "the twin's original, PER_THREAD = true"
    );
}
