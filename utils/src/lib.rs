//! Pieces shared by the limiter (injected into applications) and the node
//! hypervisor: the inline-hook engine, the per-pod shared-memory ledger
//! (usage, written by the pod) and limits (written by the hypervisor only),
//! the trusted shared-memory objects they live in, configuration parsing and
//! logging.

pub mod activity;
pub mod bucket;
pub mod clock;
pub mod config;
pub mod hook;
pub mod ledger;
pub mod limits;
pub mod logging;
pub mod priority;
pub mod process;
pub mod protocol;
pub mod shm;
pub mod thread_local;

/// The most devices a process can have limits for; device indices are `0..MAX_DEVICES`.
pub const MAX_DEVICES: usize = 16;
