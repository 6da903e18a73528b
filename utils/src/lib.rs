//! Pieces shared by the limiter (injected into applications) and the node
//! hypervisor: the per-pod shared-memory ledger (usage, written by the pod)
//! and limits (written by the hypervisor only), the node tables, the trusted
//! shared-memory objects they live in, the pod's identity and class
//! ([`pod`]), what the daemon tells a provisioned container's limiter
//! ([`pod_file`]), sizes and switches as users write them ([`units`]), small
//! files a user names, read within a bound ([`small_file`]), the GPU a
//! co-run GPU's MPS daemon serves ([`served_gpu`]), the wire
//! protocol and logging. Each side's configuration (the limiter's
//! environment, the hypervisor's file) is parsed in that side's crate.
//! The hook engine the limiter patches the driver with is `gpushare-hook`.

pub mod activity;
pub mod bucket;
pub mod clock;
pub mod fnv;
pub mod ledger;
pub mod limits;
pub mod logging;
pub mod node_table;
pub mod pod;
pub mod pod_file;
pub mod priority;
pub mod process;
pub mod protocol;
pub mod quote;
pub mod served_gpu;
pub mod shm;
pub mod small_file;
#[cfg(test)]
mod test_dir;
pub mod units;

/// The most devices a process can have limits for; device indices are `0..MAX_DEVICES`.
pub const MAX_DEVICES: usize = 16;
