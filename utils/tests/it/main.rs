//! The shared utilities' integration tests, one binary: the ledger across
//! real processes and the shared-memory readers under arbitrary contents.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod ledger_processes;
mod shm_fuzz;
