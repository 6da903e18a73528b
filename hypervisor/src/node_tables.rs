//! The node-wide tables every limited process maps: activity (which pods
//! launch on each GPU) and priority (latency pods' lines, each pod's held
//! time and queueing delay). The hypervisor is their one creator: it makes
//! them at start with `O_EXCL`, owner and mode of the pods' regions
//! (`region_uid`, `region_gid`, `region_mode`), and limiters under it only
//! open them, after checking owner, mode and size ([`gpushare_utils::shm`]).
//!
//! A table someone else made before the hypervisor started (another user
//! squatting the name, an older layout) is not adopted: it is unlinked and
//! made again. Processes that mapped the old one keep it, unseen by the rest.

use gpushare_utils::activity::{ActivityError, NODE_REGION, NodeActivity, TableAccess};
use gpushare_utils::priority::{NodePriority, PRIORITY_REGION};
use gpushare_utils::shm::{self, Creation, Trust};

use crate::config::RegionOptions;

/// Where the tables live in `/dev/shm` (tests name their own).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeTableNames {
    pub activity: String,
    pub priority: String,
}

impl Default for NodeTableNames {
    fn default() -> Self {
        Self {
            activity: NODE_REGION.to_owned(),
            priority: PRIORITY_REGION.to_owned(),
        }
    }
}

impl NodeTableNames {
    /// The default names, or those of `GPUSHARE_NODE_REGION` and
    /// `GPUSHARE_PRIORITY_REGION`, the variables limiters read them from.
    pub fn from_env() -> Self {
        let default = Self::default();
        Self {
            activity: std::env::var("GPUSHARE_NODE_REGION").unwrap_or(default.activity),
            priority: std::env::var("GPUSHARE_PRIORITY_REGION").unwrap_or(default.priority),
        }
    }
}

/// The tables, as this hypervisor made or adopted them; a table it could
/// not make is `None` (a warning said why).
pub struct NodeTables {
    pub activity: Option<NodeActivity>,
    pub priority: Option<NodePriority>,
}

impl std::fmt::Debug for NodeTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTables")
            .field("activity", &self.activity.is_some())
            .field("priority", &self.priority.is_some())
            .finish()
    }
}

impl NodeTables {
    /// Makes (or adopts from a trusted owner) both tables.
    pub fn create(names: &NodeTableNames, regions: &RegionOptions) -> Self {
        let access = TableAccess::Create {
            creation: Creation {
                uid: regions.uid,
                gid: regions.gid,
                mode: regions.mode.unwrap_or(0o600),
            },
            trust: Trust::only(&trusted(regions)),
        };
        Self {
            activity: make(&names.activity, &access, NodeActivity::open_named),
            priority: make(&names.priority, &access, NodePriority::open_named),
        }
    }

    /// Tables this process does not share (tests of the scheduler alone).
    pub fn none() -> Self {
        Self {
            activity: None,
            priority: None,
        }
    }
}

fn trusted(regions: &RegionOptions) -> Vec<u32> {
    let mut owners = vec![shm::effective_uid()];
    owners.extend(regions.uid);
    owners
}

/// Creates or adopts `name`; replaces a table it may not adopt.
fn make<T>(
    name: &str,
    access: &TableAccess,
    open: impl Fn(&str, &TableAccess) -> Result<T, ActivityError>,
) -> Option<T> {
    let refused = match open(name, access) {
        Ok(table) => return Some(table),
        Err(error) => error,
    };
    tracing::warn!(%refused, name, "replacing a node table this hypervisor did not make");
    if let Err(error) = shm::unlink(name) {
        tracing::warn!(%error, name, "cannot remove it: limited processes go without it");
        return None;
    }
    open(name, access)
        .inspect_err(|error| {
            tracing::warn!(%error, name, "no node table: limited processes go without it");
        })
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Names(NodeTableNames);

    impl Names {
        fn new(test: &str) -> Self {
            let id = format!("{}-{test}", std::process::id());
            Self(NodeTableNames {
                activity: format!("gpushare-node-test-hv-{id}"),
                priority: format!("gpushare-priority-test-hv-{id}"),
            })
        }
    }

    impl Drop for Names {
        fn drop(&mut self) {
            let _ = shm::unlink(&self.0.activity);
            let _ = shm::unlink(&self.0.priority);
        }
    }

    fn stat(name: &str) -> std::fs::Metadata {
        std::fs::metadata(format!("/dev/shm/{name}")).expect("table exists")
    }

    #[test]
    fn tables_are_made_with_the_regions_owner_and_mode_and_adopted_after_a_restart() {
        use std::os::unix::fs::MetadataExt;
        let names = Names::new("owner");
        let regions = RegionOptions {
            mode: Some(0o640),
            uid: Some(65534),
            gid: Some(65534),
        };
        let tables = NodeTables::create(&names.0, &regions);
        assert!(tables.activity.is_some() && tables.priority.is_some());
        for name in [&names.0.activity, &names.0.priority] {
            let meta = stat(name);
            assert_eq!(
                (meta.uid(), meta.gid(), meta.mode() & 0o777),
                (65534, 65534, 0o640)
            );
        }
        let inode = stat(&names.0.priority).ino();
        // A restarted hypervisor (the tables are never unmapped) adopts them.
        let again = NodeTables::create(&names.0, &regions);
        assert!(again.priority.is_some());
        assert_eq!(
            stat(&names.0.priority).ino(),
            inode,
            "adopted, not replaced"
        );
    }

    #[test]
    fn a_squatted_table_is_replaced() {
        use std::os::unix::fs::MetadataExt;
        let names = Names::new("squat");
        // Another user made the activity table first, writable by all.
        let path = format!("/dev/shm/{}", names.0.activity);
        std::fs::write(&path, vec![0u8; 4096]).expect("squat");
        std::os::unix::fs::chown(&path, Some(65533), Some(65533)).expect("chown (root)");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
            .expect("chmod");
        let squatted = stat(&names.0.activity).ino();
        let tables = NodeTables::create(&names.0, &RegionOptions::default());
        assert!(tables.activity.is_some());
        let meta = stat(&names.0.activity);
        assert_ne!(meta.ino(), squatted);
        assert_eq!(
            (meta.uid(), meta.mode() & 0o777),
            (shm::effective_uid(), 0o600)
        );
    }
}
