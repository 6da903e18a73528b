//! The command channel's integration tests, one binary: end to end on
//! loopback and over a Unix socket, every refusal, and a seeded fuzz.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod common;

mod channel;
mod errors;
mod fuzz;
mod unix_socket;
