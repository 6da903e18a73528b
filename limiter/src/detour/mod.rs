//! The detours, one module per intercepted API family. Each family has a thin
//! `hooks.rs` (declarations: the generated `extern "C"` adapters and the
//! install table) and an `ops.rs` (the logic, returning `Result`).

pub mod context;
pub mod driver;
pub mod held;
pub mod launch;
pub mod memory;
pub mod nvml;
