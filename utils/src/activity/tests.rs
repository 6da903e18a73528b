use super::*;
use crate::node_table::{FUTURE_SLACK_NS, pod_key};
use crate::shm::{Creation, ShmError, Trust};

const MS: u64 = 1_000_000;

fn local() -> TableAccess {
    TableAccess::local(None)
}

struct Table(String, NodeActivity);

impl Table {
    fn new(test: &str) -> Self {
        let name = format!("gpushare-activity-test-{}-{test}", std::process::id());
        let table = NodeActivity::open_named(&name, &local()).expect("map");
        Self(name, table)
    }
}

impl Drop for Table {
    fn drop(&mut self) {
        let _ignored = std::fs::remove_file(format!("/dev/shm/{}", self.0));
    }
}

#[test]
fn other_recent_pods_contend_and_old_ones_do_not() {
    let table = Table::new("contend");
    let (a, b) = (pod_key("a"), pod_key("b"));
    let now = 100_000 * MS;
    table.1.mark(0, a, now);
    assert!(
        !table.1.contended(0, a, now),
        "a pod never contends with itself"
    );
    table.1.mark(0, b, now);
    assert!(table.1.contended(0, a, now + 10 * MS));
    assert!(!table.1.contended(1, a, now), "other devices are separate");
    assert!(!table.1.contended(0, a, now + ACTIVE_WINDOW_NS + 1));
}

#[test]
fn two_mappings_see_the_same_table() {
    let table = Table::new("shared");
    let other =
        NodeActivity::open_named(&table.0, &TableAccess::managed(None)).expect("second map");
    other.mark(3, pod_key("x"), 5 * MS);
    assert!(table.1.contended(3, pod_key("y"), 6 * MS));
}

#[test]
fn stale_slots_are_reused() {
    let table = Table::new("stale");
    for pod in 0..PODS_PER_DEVICE as u64 {
        table.1.mark(0, pod + 10, MS);
    }
    let late = 20_000_000 * MS;
    table.1.mark(0, 999, late);
    assert!(table.1.contended(0, 1, late));
}

#[test]
fn the_creator_writes_the_header_and_a_wrong_one_makes_the_table_unread() {
    let table = Table::new("header");
    assert!(table.1.is_sound() && table.1.header_is_exact());
    let (a, b) = (pod_key("a"), pod_key("b"));
    let now = 100_000 * MS;
    table.1.mark(0, b, now);
    assert!(table.1.contended(0, a, now));
    // Any word of the header wrong: the table reads as empty.
    let header = table.1.header();
    header
        .shape
        .store(ACTIVITY_LAYOUT.shape + 1, Ordering::Relaxed);
    assert!(!table.1.is_sound() && !table.1.contended(0, a, now));
    header.write(&ACTIVITY_LAYOUT);
    assert!(table.1.contended(0, a, now));
    header.reserved[3].store(1, Ordering::Relaxed);
    assert!(
        table.1.is_sound(),
        "reserved words are not the launch's check"
    );
    assert!(!table.1.header_is_exact(), "but the hypervisor's");
    // Random bytes: any magic but the right one.
    header.magic.store(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
    assert!(!table.1.contended(0, a, now));
    // Another process opening the table takes it as it is.
    let other = NodeActivity::open_named(&table.0, &TableAccess::managed(None)).expect("map");
    assert!(!other.is_sound());
}

#[test]
fn stamps_from_the_future_are_ignored_and_their_slots_taken() {
    let table = Table::new("future");
    let slots = &table.1.table.devices[0];
    let now = 100_000 * MS;
    // Garbage in every slot: pod keys with stamps far past any clock.
    for (n, slot) in slots.iter().enumerate() {
        slot.pod.store(0xdead_0000 + n as u64, Ordering::Relaxed);
        slot.active_at_ns
            .store(u64::MAX - n as u64, Ordering::Relaxed);
    }
    assert!(!table.1.contended(0, pod_key("a"), now));
    // Within the slack, a stamp is a peer's clock read a little later.
    slots[0]
        .active_at_ns
        .store(now + FUTURE_SLACK_NS, Ordering::Relaxed);
    assert!(table.1.contended(0, pod_key("a"), now));
    slots[0]
        .active_at_ns
        .store(now + FUTURE_SLACK_NS + 1, Ordering::Relaxed);
    assert!(!table.1.contended(0, pod_key("a"), now));
    // A pod finds a slot among them: the garbage held none for ever.
    table.1.mark(0, pod_key("b"), now);
    assert!(table.1.contended(0, pod_key("a"), now + MS));
}

#[test]
fn fresh_access_never_opens_a_table_that_exists() {
    let table = Table::new("fresh");
    let error = NodeActivity::open_named(&table.0, &TableAccess::Fresh(Creation::default()))
        .err()
        .expect("refused");
    assert!(matches!(error, ActivityError::Exists { .. }), "{error}");
    let name = format!("gpushare-activity-test-{}-fresh-new", std::process::id());
    let fresh = Table(
        name.clone(),
        NodeActivity::open_named(&name, &TableAccess::Fresh(Creation::default())).expect("made"),
    );
    assert!(fresh.1.header_is_exact());
}

#[test]
fn a_table_someone_else_made_is_refused_not_adopted() {
    let name = format!("gpushare-activity-test-{}-squat", std::process::id());
    let _cleanup = Table(
        name.clone(),
        NodeActivity::open_named(&name, &local()).expect("map"),
    );
    // Owned by a uid the opener does not trust (as if another user had
    // created it first): neither the creator nor an opener maps it.
    let path = format!("/dev/shm/{name}");
    std::os::unix::fs::chown(&path, Some(65533), None).expect("chown (tests run as root)");
    let trust = Trust::only(&[crate::shm::effective_uid()]);
    for access in [
        TableAccess::Open(trust.clone()),
        TableAccess::Create {
            creation: Creation::default(),
            trust,
        },
    ] {
        let error = NodeActivity::open_named(&name, &access)
            .err()
            .expect("refused");
        assert!(
            matches!(
                error,
                ActivityError::Shm(ShmError::UntrustedOwner { uid: 65533, .. })
            ),
            "{error}"
        );
    }
    // Writable by others: refused even from a trusted owner.
    std::os::unix::fs::chown(&path, Some(crate::shm::effective_uid()), None).expect("chown");
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o666))
        .expect("chmod");
    let error = NodeActivity::open_named(&name, &local())
        .err()
        .expect("refused");
    assert!(
        matches!(error, ActivityError::Shm(ShmError::Writable { .. })),
        "{error}"
    );
}

#[test]
fn a_link_or_a_wrong_size_is_refused_and_absent_is_said() {
    let base = format!("gpushare-activity-test-{}-", std::process::id());
    let real = Table::new("link-target");
    let link = format!("{base}link");
    std::os::unix::fs::symlink(format!("/dev/shm/{}", real.0), format!("/dev/shm/{link}"))
        .expect("symlink");
    let through_link = NodeActivity::open_named(&link, &local()).err();
    let _ = std::fs::remove_file(format!("/dev/shm/{link}"));
    assert!(
        matches!(
            through_link,
            Some(ActivityError::Shm(ShmError::Open { .. }))
        ),
        "{through_link:?}"
    );
    let short = format!("{base}short");
    std::fs::write(format!("/dev/shm/{short}"), [0u8; 4096]).expect("write");
    let error = NodeActivity::open_named(&short, &local()).err();
    let _ = std::fs::remove_file(format!("/dev/shm/{short}"));
    assert!(
        matches!(
            error,
            Some(ActivityError::Shm(ShmError::Size { found: 4096, .. }))
        ),
        "{error:?}"
    );
    let missing = format!("{base}missing");
    let error = NodeActivity::open_named(&missing, &TableAccess::managed(None)).err();
    assert!(
        matches!(error, Some(ActivityError::Absent { .. })),
        "{error:?}"
    );
    assert!(!std::path::Path::new(&format!("/dev/shm/{missing}")).exists());
}
