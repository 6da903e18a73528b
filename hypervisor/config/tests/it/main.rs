//! The config crate's integration tests, one binary: the file and the
//! admin limits body parsed.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod config;
