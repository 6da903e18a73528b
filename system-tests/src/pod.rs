//! A test's pod: an identity of its own, whose shared objects in `/dev/shm`
//! are removed after the test whatever its outcome, and the node tables its
//! processes and its daemon use instead of the node's.

use std::path::Path;

use gpushare_utils::node_table::NodeTableNames;

use crate::scratch::Scratch;

/// A pod identity of its own for each test; its ledger, limits and test node
/// tables are removed after, whatever the test's outcome.
pub struct Pod(pub String);

impl Pod {
    /// `t-<test>-<pid>-<n>`: unique in this process and among concurrent
    /// test processes.
    pub fn new(test: &str) -> Self {
        Self(crate::unique::name(&format!("t-{test}")))
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        let tables = node_tables(self);
        let names = Scratch::region_names(&self.0)
            .into_iter()
            .chain([tables.activity, tables.priority]);
        for name in names {
            let _ignored = std::fs::remove_file(Path::new("/dev/shm").join(name));
        }
    }
}

/// The node tables of `pod`'s test, in place of the node's (removed with
/// the pod): what its daemon makes and its processes are pointed at.
pub fn node_tables(pod: &Pod) -> NodeTableNames {
    NodeTableNames {
        activity: format!("gpushare-node-test-{}", pod.0),
        priority: format!("gpushare-priority-test-{}", pod.0),
    }
}
