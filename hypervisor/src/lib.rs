//! The per-node GPU-sharing daemon, composed: the `hypervisor` binary's
//! library part.
//!
//! [`node`]: one node's daemon started from its crates, the one start-up
//! path of the binary, the test cluster and `k8s-e2e`.
//! [`limiter_files`]: the limiter library installed on the host under a
//! versioned name and collected once no process maps it.
//! [`status_table`]: the daemon's status as `hypervisor status` prints it.

pub mod limiter_files;
pub mod node;
pub mod status_table;

pub use node::{BoundNode, Node, NodeError, NodeSpec};
