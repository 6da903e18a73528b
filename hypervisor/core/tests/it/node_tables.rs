//! The node tables the daemon makes and repairs: owner, mode, squats,
//! headers, tampering (`hypervisor_core::node_tables`).

use gpushare_utils::activity::ACTIVITY_LAYOUT;
use gpushare_utils::activity::NodeActivity;
use gpushare_utils::node_table::NodeTable;
use gpushare_utils::priority::NodePriority;
use gpushare_utils::priority::PRIORITY_LAYOUT;
use gpushare_utils::shm;
use hypervisor_core::node_tables::{NodeTableNames, NodeTables, Repairs};
use hypervisor_core::region::RegionOptions;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;

fn path(name: &str) -> String {
    format!("/dev/shm/{name}")
}

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

/// Whether both tables are made, their headers exact.
fn both_exact(tables: &NodeTables) -> bool {
    tables
        .activity
        .as_ref()
        .is_some_and(NodeActivity::header_is_exact)
        && tables
            .priority
            .as_ref()
            .is_some_and(NodePriority::header_is_exact)
}

fn stat(name: &str) -> std::fs::Metadata {
    std::fs::metadata(path(name)).expect("table exists")
}

fn pods_regions() -> RegionOptions {
    RegionOptions {
        mode: Some(0o640),
        uid: Some(65534),
        gid: Some(65534),
    }
}

#[test]
fn tables_are_made_with_the_regions_owner_and_mode_and_made_again_after_a_restart() {
    let names = Names::new("owner");
    let regions = pods_regions();
    let tables = NodeTables::create(&names.0, &regions);
    assert!(tables.activity.is_some() && tables.priority.is_some());
    for name in [&names.0.activity, &names.0.priority] {
        let meta = stat(name);
        assert_eq!(
            (meta.uid(), meta.gid(), meta.mode() & 0o777),
            (65534, 65534, 0o640)
        );
    }
    assert!(both_exact(&tables));
    let inode = stat(&names.0.priority).ino();
    // A restarted hypervisor (the tables are never unmapped) cannot tell
    // them from tables a pod of the region's uid planted: made again.
    let again = NodeTables::create(&names.0, &regions);
    assert!(again.priority.is_some());
    assert_ne!(
        stat(&names.0.priority).ino(),
        inode,
        "replaced, not adopted"
    );
}

#[test]
fn a_squatted_table_is_replaced() {
    let names = Names::new("squat");
    // Another user made the activity table first, writable by all.
    let path = path(&names.0.activity);
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

#[test]
fn a_table_the_pods_uid_planted_with_the_right_size_and_mode_is_replaced() {
    let names = Names::new("planted");
    // What a pod of uid 65534 can make before the daemon starts: exact
    // size, mode 0600, its own; with the right header or any other.
    for (name, size) in [
        (&names.0.activity, ACTIVITY_LAYOUT.size),
        (&names.0.priority, PRIORITY_LAYOUT.size),
    ] {
        let path = path(name);
        let mut bytes = vec![0x5a; usize::try_from(size).expect("size")];
        bytes[..8].copy_from_slice(&ACTIVITY_LAYOUT.magic.to_le_bytes());
        std::fs::write(&path, bytes).expect("plant");
        std::os::unix::fs::chown(&path, Some(65534), Some(65534)).expect("chown (root)");
        std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
            .expect("chmod");
    }
    let planted = [stat(&names.0.activity).ino(), stat(&names.0.priority).ino()];
    let regions = RegionOptions {
        mode: None,
        ..pods_regions()
    };
    let tables = NodeTables::create(&names.0, &regions);
    let made = [stat(&names.0.activity).ino(), stat(&names.0.priority).ino()];
    assert!(made[0] != planted[0] && made[1] != planted[1], "adopted");
    assert!(
        tables
            .activity
            .as_ref()
            .is_some_and(NodeActivity::header_is_exact)
    );
    let priority = tables.priority.as_ref().expect("priority table");
    assert!(priority.header_is_exact());
    assert_eq!(
        priority.latency(0, 1),
        Default::default(),
        "the planted lines are gone"
    );
}

#[test]
fn a_directory_or_a_link_at_a_tables_name_is_replaced_without_being_followed() {
    let names = Names::new("links");
    // A directory with a file in it at one name, a link to a file
    // outside /dev/shm at the other.
    let directory = path(&names.0.activity);
    std::fs::create_dir(&directory).expect("directory");
    std::fs::write(format!("{directory}/inside"), b"x").expect("file inside");
    let target = std::env::temp_dir().join(format!("node-table-link-{}", std::process::id()));
    std::fs::write(&target, b"kept").expect("target");
    std::os::unix::fs::symlink(&target, path(&names.0.priority)).expect("link");
    let tables = NodeTables::create(&names.0, &pods_regions());
    let target_text = std::fs::read(&target);
    let _ = std::fs::remove_file(&target);
    assert_eq!(target_text.expect("the link's target"), b"kept");
    for name in [&names.0.activity, &names.0.priority] {
        let meta = std::fs::symlink_metadata(path(name)).expect("made");
        assert!(meta.file_type().is_file(), "{name}: {meta:?}");
    }
    assert!(both_exact(&tables));
}

#[test]
fn the_check_rewrites_a_wrong_header_and_remakes_a_table_tampered_with() {
    let names = Names::new("check");
    let mut tables = NodeTables::create(&names.0, &pods_regions());
    tables.check();
    assert_eq!(tables.repairs(), Repairs::default(), "nothing to repair");

    // Garbage over the priority table's header: rewritten in place.
    let priority = tables.priority.as_ref().expect("priority");
    priority
        .header()
        .magic
        .store(0x0123_4567_89ab_cdef, Ordering::Relaxed);
    priority.header().reserved[0].store(7, Ordering::Relaxed);
    let inode = stat(&names.0.priority).ino();
    tables.check();
    let priority = tables.priority.as_ref().expect("priority");
    assert!(priority.header_is_exact());
    assert_eq!(stat(&names.0.priority).ino(), inode, "repaired in place");
    assert_eq!(tables.repairs().priority, 1);

    // The activity table shrunk, then replaced by another object: made
    // again, each time.
    let activity = path(&names.0.activity);
    std::fs::File::options()
        .write(true)
        .open(&activity)
        .and_then(|file| file.set_len(0))
        .expect("shrink");
    tables.check();
    let meta = stat(&names.0.activity);
    assert_eq!(meta.len(), ACTIVITY_LAYOUT.size);
    assert!(
        tables
            .activity
            .as_ref()
            .is_some_and(NodeActivity::header_is_exact)
    );
    assert_eq!(tables.repairs().activity, 1);
    shm::unlink(&names.0.activity).expect("unlink");
    std::fs::write(&activity, vec![0u8; 64]).expect("plant");
    tables.check();
    assert_ne!(stat(&names.0.activity).ino(), meta.ino());
    assert_eq!(stat(&names.0.activity).len(), ACTIVITY_LAYOUT.size);
    assert_eq!(tables.repairs().activity, 2);
}

#[test]
fn the_check_sets_a_tables_mode_back_in_place() {
    use std::os::unix::fs::PermissionsExt;
    let names = Names::new("mode");
    let mut tables = NodeTables::create(&names.0, &pods_regions());
    // The pods' uid owns the tables and may chmod them: at mode 000 no
    // limiter of that uid opens them; at 0666 anyone may write them.
    for (name, mode) in [(&names.0.activity, 0o000), (&names.0.priority, 0o666)] {
        let inode = stat(name).ino();
        std::fs::set_permissions(path(name), std::fs::Permissions::from_mode(mode)).expect("chmod");
        tables.check();
        let meta = stat(name);
        assert_eq!(meta.mode() & 0o7777, 0o640, "{name}");
        assert_eq!(meta.ino(), inode, "{name}: set back in place");
    }
    assert_eq!(
        tables.repairs(),
        Repairs {
            activity: 1,
            priority: 1
        }
    );
    tables.check();
    assert_eq!(tables.repairs().activity, 1, "nothing more to repair");
}
