//! What the detour tests share: a return type for their "driver" functions,
//! and a handler error that asks for the original.

use gpushare_hook::{Disposition, IntoReturn, Unavailable};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(crate) struct Status(pub(crate) u64);

// SAFETY: a plain integer.
unsafe impl gpushare_hook::thread_local::ZeroInit for Status {}

impl Unavailable for Status {
    const UNAVAILABLE: Self = Status(u64::MAX);
}

/// A handler error that asks for the original.
#[allow(dead_code, reason = "not every test file uses it")]
pub(crate) struct Bypass;

impl IntoReturn<Status> for Bypass {
    fn into_return(self) -> Disposition<Status> {
        Disposition::CallOriginal
    }
}
