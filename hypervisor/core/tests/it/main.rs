//! The daemon core's integration tests, one binary: the node tables and
//! the turn plan.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod node_tables;
mod turn_flags;
mod turns;
