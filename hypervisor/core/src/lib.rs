//! The node daemon's decisions: what a pod is given and how each GPU's time
//! is split. Its only I/O is the node's shared memory (`/dev/shm`) and
//! `/proc`: a process's cgroup and pid namespaces ([`identity`]), and a
//! region object's mode read through its descriptor. No network, and no
//! file a user names: the config file is `hypervisor-config`'s.
//!
//! - [`spec`]: a pod as the daemon knows it (GPUs, memory, weight, cap,
//!   policy, token).
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
