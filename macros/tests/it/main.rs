//! The detour macro's tests, one binary: what a generated detour calls, and
//! when.

mod common;

mod around;
mod forwarding;
mod ptsz_twin;
