//! The node daemon's decisions, without any I/O beyond the node's shared
//! memory: what a pod is given and how each GPU's time is split.
//!
//! - [`spec`]: a pod as the daemon knows it (GPUs, memory, weight, cap,
//!   policy, token); [`config`]: the TOML file that lists pods and settings.
//! - [`fairshare`]: weighted water-filling of a GPU's time among the pods
//!   that want it.
//! - [`region`]: each pod's ledger and read-only limits object in
//!   `/dev/shm`, and the removal of anything planted at their names
//!   ([`region::squat`]); [`node_tables`]: the node-wide activity and
//!   priority tables the limiters read; [`priority`]: the classes' status;
//!   [`turns`]: which GPUs' batch pods take turns (their flags too).
//! - [`scheduler`]: pods applied from a spec list, the 10 ms tick that sets
//!   each bucket's rate, admission of launches that found no budget.
//! - [`workers`]: the limited processes registered with the daemon;
//!   [`identity`]: which pod a process is in, from its cgroup.
//!
//! The running daemon (HTTP, tasks) is `hypervisor-daemon`; nothing here
//! depends on it, on Kubernetes or on gRPC.

pub mod config;
pub mod fairshare;
pub mod file_error;
pub mod identity;
pub mod node_tables;
pub mod priority;
pub mod region;
pub mod scheduler;
pub mod spec;
pub mod turns;
pub mod workers;
