//! The limiter's integration tests, one binary: the built library preloaded
//! into probe programs on the driver double (memory quotas, compute shares,
//! priorities, turns, loading).

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod common;

mod compute_share;
mod dynamic_shapes;
mod fast_swap;
mod fast_swap_ipc;
mod fast_swap_moves;
mod glibc_baseline;
mod loading;
mod memory_quota;
mod oversubscription;
mod pod_sharing;
mod priority;
mod readme_demo;
mod swap_gate;
mod turns;
