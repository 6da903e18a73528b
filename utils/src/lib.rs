//! Pieces shared by the limiter (injected into applications) and the node
//! hypervisor: the per-pod shared-memory ledger (usage, written by the pod)
//! and limits (written by the hypervisor only), the node tables, the trusted
//! shared-memory objects they live in, configuration parsing and logging.
//! The hook engine the limiter patches the driver with is `gpushare-hook`.

pub mod activity;
pub mod bucket;
pub mod clock;
pub mod config;
pub mod ledger;
pub mod limits;
pub mod logging;
pub mod priority;
pub mod process;
pub mod protocol;
pub mod shm;

/// The most devices a process can have limits for; device indices are `0..MAX_DEVICES`.
pub const MAX_DEVICES: usize = 16;
