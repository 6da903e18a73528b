//! The shared utilities' integration tests, one binary: the ledger across
//! real processes and the shared-memory readers under arbitrary contents.

mod ledger_processes;
mod shm_fuzz;
