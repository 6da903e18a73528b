//! The detours, one module per intercepted API family. Each family has a thin
//! `hooks.rs` (declarations: the generated `extern "C"` adapters and the
//! install table) and an `ops.rs` (the logic, returning `Result`).

pub(crate) mod context;
pub(crate) mod driver;
pub(crate) mod gate;
pub(crate) mod held;
pub(crate) mod ipc;
pub(crate) mod launch;
pub(crate) mod memory;
pub(crate) mod nvml;
pub(crate) mod pointer;
mod room;
