//! The node tables the daemon makes: a table found under a table's name at
//! start is never adopted, even one a pod of the regions' uid could have
//! planted with everything right (exact size, mode 0600, its owner, the
//! right header): the daemon replaces it and its log says so.

use crate::common;

use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::process::Stdio;

use common::ConfigFile;
use common::daemon::{listening, serve};
use gpushare_utils::activity::{ACTIVITY_LAYOUT, NodeActivity};
use gpushare_utils::node_table::{NodeTable, TableAccess, TableLayout};
use gpushare_utils::priority::{LatencyView, NodePriority, PRIORITY_LAYOUT};

/// The uid the pods run as (the daemon's `region_uid`).
const PODS_UID: u32 = 65534;

/// What a pod of uid [`PODS_UID`] can leave at `name`: the table's exact
/// size, its own, mode 0600, with the layout's header and every line of
/// device 0's latency pod stamped "active now and for ever".
fn plant(name: &str, layout: &TableLayout) -> u64 {
    let mut bytes = vec![0u8; usize::try_from(layout.size).expect("size")];
    let header = [
        layout.magic.to_le_bytes().as_slice(),
        &layout.version.to_le_bytes(),
        &64u32.to_le_bytes(),
        &layout.size.to_le_bytes(),
        &layout.shape.to_le_bytes(),
    ]
    .concat();
    bytes[..header.len()].copy_from_slice(&header);
    bytes[64..128].fill(0xff);
    let path = format!("/dev/shm/{name}");
    std::fs::write(&path, bytes).expect("plant");
    std::os::unix::fs::chown(&path, Some(PODS_UID), Some(PODS_UID)).expect("chown (root)");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    std::fs::metadata(&path).expect("planted").ino()
}

#[test]
fn tables_planted_before_the_daemon_starts_are_replaced_and_the_log_says_so() {
    let config = ConfigFile::new(&format!(
        "listen = \"127.0.0.1:0\"\nregion_uid = {PODS_UID}\nregion_gid = {PODS_UID}\n"
    ));
    let tables = common::node_tables(&config.path);
    let planted = [
        plant(&tables.activity, &ACTIVITY_LAYOUT),
        plant(&tables.priority, &PRIORITY_LAYOUT),
    ];

    let mut serve = serve(&config);
    serve.env_remove("HYPERVISOR_LOG").stderr(Stdio::piped());
    let (mut daemon, _addr) = listening(serve);

    // Made anew: other objects, the pods' own, with the daemon's header and
    // empty lines.
    let made = [&tables.activity, &tables.priority]
        .map(|name| std::fs::metadata(format!("/dev/shm/{name}")).expect("table exists"));
    for (meta, planted) in made.iter().zip(planted) {
        assert_ne!(meta.ino(), planted, "adopted");
        assert_eq!((meta.uid(), meta.mode() & 0o777), (PODS_UID, 0o600));
    }
    let access = TableAccess::managed(Some(PODS_UID));
    let activity = NodeActivity::open_named(&tables.activity, &access).expect("activity");
    let priority = NodePriority::open_named(&tables.priority, &access).expect("priority");
    assert!(activity.header_is_exact() && priority.header_is_exact());
    assert_eq!(priority.latency(0, 1_000), LatencyView::default());

    // The log so far: the daemon warned before it listened.
    daemon.0.kill().expect("kill");
    daemon.0.wait().expect("wait");
    let mut log = String::new();
    daemon
        .0
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("log");
    for name in [&tables.activity, &tables.priority] {
        let said = log.lines().any(|line| {
            line.contains("WARN")
                && line.contains("replacing the node table found at start")
                && line.contains(name.as_str())
                && line.contains(&format!("uid {PODS_UID} mode 0600"))
        });
        assert!(said, "no warning of {name} replaced: {log}");
    }
}
