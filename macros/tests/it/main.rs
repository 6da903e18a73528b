//! The detour macro's tests, one binary: what a generated detour calls, and
//! when.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod common;

mod around;
mod forwarding;
mod ptsz_twin;
