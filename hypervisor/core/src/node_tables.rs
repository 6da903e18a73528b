//! The node-wide tables every limited process maps: activity (which pods
//! launch on each GPU) and priority (latency pods' lines, each pod's held
//! time and queueing delay, each GPU's turns). The hypervisor is their one
//! creator: it makes them at start with `O_EXCL|O_NOFOLLOW`, owner and mode
//! of the pods' regions (`region_uid`, `region_gid`, `region_mode`), and
//! limiters under it only open them, after checking owner, mode and size
//! ([`gpushare_utils::shm`]).
//!
//! A table found under a table's name at start is never adopted: the pods'
//! uid may write (and so plant) one of the right size, owner and mode, and
//! nothing tells it from one an earlier run made. Whatever stands at the
//! name (a file, a link, a directory) is removed without being followed, as
//! at a pod's names ([`crate::region::squat`]), and the table made again,
//! with a warning. Processes that mapped the old one keep it, unseen
//! by the rest.
//!
//! Every pod may write the tables, so maintenance checks them every second
//! ([`NodeTables::check`]): a header that is not exactly the layout's is
//! rewritten in place (readers ignore a table with a wrong header, so until
//! then it held nobody), and so is a mode changed (at mode 000 no limiter of
//! the pods' uid could open it); a table shrunk, removed, replaced under its
//! name or given another owner is made again, at most [`MAX_REMAKES`] times
//! (each leaves the old mapping in this process: tables are never unmapped).
//! Each repair is logged and counted ([`NodeTables::repairs`],
//! `gpushare_node_table_repairs_total` in `/metrics`). The same check sets
//! the turn lines as the daemon's [`TurnPlan`] says (pods may write them
//! too).

use std::os::unix::fs::MetadataExt;

use gpushare_utils::activity::NodeActivity;
use gpushare_utils::node_table::{ActivityError, NodeTable, TableAccess};
use gpushare_utils::priority::NodePriority;
use gpushare_utils::shm::{self, Creation};

use crate::region::RegionOptions;
use crate::region::entry::{self, Entry, inspect, restore_mode};
use crate::turns::TurnPlan;

/// Where the tables live (the daemon's: `GPUSHARE_NODE_REGION`,
/// `GPUSHARE_PRIORITY_REGION` or the defaults).
pub use gpushare_utils::node_table::NodeTableNames;

/// Which node table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TableKind {
    /// Which pods launch on each GPU (`/dev/shm/gpushare-node-v2`), read by
    /// elastic pods to take idle time.
    Activity,
    /// Latency pods' lines, each pod's held time and queueing delay, and
    /// each GPU's turns (`/dev/shm/gpushare-priority-v3`).
    Priority,
}

impl TableKind {
    /// Both tables, in the order [`NodeTables`] checks and reports them.
    pub const ALL: [Self; 2] = [Self::Activity, Self::Priority];

    /// The `table` label of the repairs counter.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Activity => "activity",
            Self::Priority => "priority",
        }
    }
}

/// How many times a table is made again after it was tampered with; past
/// that a warning says it is left as it is.
pub const MAX_REMAKES: u32 = 8;

/// How many times this hypervisor repaired each table ([`NodeTables::check`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Repairs {
    /// Repairs of the activity table: headers rewritten, tables made again.
    pub activity: u64,
    /// Repairs of the priority table: headers rewritten, tables made again.
    pub priority: u64,
}

impl Repairs {
    /// The count of `table`.
    pub fn of(&self, table: TableKind) -> u64 {
        match table {
            TableKind::Activity => self.activity,
            TableKind::Priority => self.priority,
        }
    }

    fn count(&mut self, table: TableKind) {
        match table {
            TableKind::Activity => self.activity += 1,
            TableKind::Priority => self.priority += 1,
        }
    }
}

/// The tables, as this hypervisor made them; a table it could not make is
/// `None` (a warning said why).
pub struct NodeTables {
    /// The activity table, as mapped now; `None`: it could not be made (a
    /// warning said why), and no limiter of the node has one.
    pub activity: Option<NodeActivity>,
    /// The priority table, as mapped now; `None`: it could not be made,
    /// batch launches are never held for latency pods and the status has no
    /// priority figures.
    pub priority: Option<NodePriority>,
    /// How they were made, to check them (none for [`NodeTables::none`]).
    made: Option<Made>,
    repairs: Repairs,
    /// Which GPUs take turns: set in the priority table at every check.
    turns: TurnPlan,
}

/// How this hypervisor made its tables, and which objects it made.
struct Made {
    names: NodeTableNames,
    creation: Creation,
    /// Each table's object ([`TableKind`] order).
    objects: [Object; 2],
}

/// The object this hypervisor made for a table.
#[derive(Debug, Clone, Copy)]
struct Object {
    /// Its inode, to see the name taken over by another object.
    inode: Option<u64>,
    /// How many times it was made again.
    remakes: u32,
}

impl std::fmt::Debug for NodeTables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeTables")
            .field("activity", &self.activity.is_some())
            .field("priority", &self.priority.is_some())
            .finish_non_exhaustive()
    }
}

impl NodeTables {
    /// Makes both tables, replacing whatever is found under their names.
    pub fn create(names: &NodeTableNames, regions: &RegionOptions) -> Self {
        let creation = Creation {
            uid: regions.uid,
            gid: regions.gid,
            mode: regions.mode.unwrap_or(0o600),
        };
        let (activity, activity_inode) = make(&names.activity, &creation);
        let (priority, priority_inode) = make(&names.priority, &creation);
        let object = |inode| Object { inode, remakes: 0 };
        Self {
            activity,
            priority,
            made: Some(Made {
                names: names.clone(),
                creation,
                objects: [object(activity_inode), object(priority_inode)],
            }),
            repairs: Repairs::default(),
            turns: TurnPlan::default(),
        }
    }

    /// Tables this process does not share (tests of the scheduler alone).
    pub fn none() -> Self {
        Self {
            activity: None,
            priority: None,
            made: None,
            repairs: Repairs::default(),
            turns: TurnPlan::default(),
        }
    }

    /// From now on, the priority table's turn lines say what `plan` says:
    /// set now, and again at every [`Self::check`].
    pub fn set_turns(&mut self, plan: TurnPlan) {
        self.turns = plan;
        if let Some(priority) = &self.priority {
            self.turns.apply(priority);
        }
    }

    /// `capped` batch pods with a compute cap want GPU `uuid` at `now`
    /// ([`TurnPlan::contended`]): where that starts or stops its turns, its
    /// line says so at once.
    pub fn contended(&mut self, uuid: &str, capped: usize, now: std::time::Instant) {
        if self.turns.contended(uuid, capped, now)
            && let Some(priority) = &self.priority
        {
            self.turns.apply(priority);
        }
    }

    /// Which GPUs take turns.
    pub fn turns(&self) -> &TurnPlan {
        &self.turns
    }

    /// Checks both tables (maintenance, every second): rewrites a wrong
    /// header in place, makes again a table shrunk, removed, replaced or
    /// given another owner or mode; logs and counts each repair. Then sets
    /// the turn lines as the [`TurnPlan`] says.
    pub fn check(&mut self) {
        let Some(made) = &mut self.made else {
            return;
        };
        let [activity, priority] = &mut made.objects;
        if check(
            TableKind::Activity,
            &made.names.activity,
            &made.creation,
            activity,
            &mut self.activity,
        ) {
            self.repairs.count(TableKind::Activity);
        }
        if check(
            TableKind::Priority,
            &made.names.priority,
            &made.creation,
            priority,
            &mut self.priority,
        ) {
            self.repairs.count(TableKind::Priority);
        }
        if let Some(priority) = &self.priority {
            self.turns.apply(priority);
        }
    }

    /// How many times [`Self::check`] repaired each table.
    pub fn repairs(&self) -> Repairs {
        self.repairs
    }
}

/// What is wrong with a table this hypervisor made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Damage {
    /// Its header is not exactly its layout's: readers ignore the table.
    Header,
    /// Its mode is not the one it was made with (these bits): limiters may
    /// not open it, or others may write it.
    Mode(u32),
    /// It was shrunk, or its name now names no object or another one, or
    /// its owner changed: limiters opening it get another table or none.
    Object(&'static str),
}

/// Checks `table` and repairs what is wrong; whether it repaired it.
fn check<T: NodeTable>(
    kind: TableKind,
    name: &str,
    creation: &Creation,
    object: &mut Object,
    table: &mut Option<T>,
) -> bool {
    let Some(current) = table.as_ref() else {
        return false;
    };
    if object.remakes > MAX_REMAKES {
        return false;
    }
    let Some(damage) = damage(current, name, creation, object.inode) else {
        return false;
    };
    match damage {
        Damage::Header => {
            current.header().write(&T::LAYOUT);
            tracing::warn!(
                table = kind.as_str(),
                name,
                "a node table's header was overwritten (readers ignored the table): rewritten"
            );
            true
        }
        Damage::Mode(found) => {
            let made = made(creation, inode_of(object), T::LAYOUT.size);
            match restore_mode(name, &made) {
                Ok(()) => {
                    tracing::warn!(
                        table = kind.as_str(),
                        name,
                        mode = %format!("{found:04o}"),
                        "a node table's mode was changed: set back"
                    );
                    true
                }
                Err(error) => {
                    tracing::warn!(table = kind.as_str(), name, %error, "a node table's mode was changed and cannot be set back: made again");
                    remake(kind, name, creation, object, table, "given another mode")
                }
            }
        }
        Damage::Object(what) if object.remakes == MAX_REMAKES => {
            object.remakes += 1;
            tracing::error!(
                table = kind.as_str(),
                name,
                what,
                "a node table was tampered with again: left as it is (made again {MAX_REMAKES} times already)"
            );
            false
        }
        Damage::Object(what) => remake(kind, name, creation, object, table, what),
    }
}

/// Makes `table` again after `what` was done to it.
fn remake<T: NodeTable>(
    kind: TableKind,
    name: &str,
    creation: &Creation,
    object: &mut Object,
    table: &mut Option<T>,
    what: &str,
) -> bool {
    tracing::warn!(
        table = kind.as_str(),
        name,
        what,
        "a node table was tampered with: made again (processes that mapped the old one keep it)"
    );
    let (remade, inode) = make(name, creation);
    let repaired = remade.is_some();
    *table = remade;
    *object = Object {
        inode,
        remakes: object.remakes + 1,
    };
    repaired
}

fn inode_of(object: &Object) -> u64 {
    object.inode.unwrap_or(0)
}

/// A table as made with `creation` (inode `inode`, `size` bytes).
fn made(creation: &Creation, inode: u64, size: u64) -> entry::Made {
    entry::Made {
        inode,
        size,
        uid: creation.uid.unwrap_or_else(shm::effective_uid),
        // As `shm::create` sets it.
        mode: creation.mode & 0o755,
    }
}

/// What is wrong with `table`, made as `name` with `creation` (inode
/// `inode`), if anything.
fn damage<T: NodeTable>(
    table: &T,
    name: &str,
    creation: &Creation,
    inode: Option<u64>,
) -> Option<Damage> {
    if table.is_broken() {
        return Some(Damage::Object("shrunk"));
    }
    let Some(inode) = inode else {
        return Some(Damage::Object("replaced"));
    };
    match inspect(name, &made(creation, inode, T::LAYOUT.size)) {
        Entry::Damaged(what) => Some(Damage::Object(what)),
        Entry::Mode(found) => Some(Damage::Mode(found)),
        Entry::Intact if !table.header_is_exact() => Some(Damage::Header),
        Entry::Intact => None,
    }
}

fn path(name: &str) -> String {
    format!("/dev/shm/{name}")
}

/// Makes `name` (`O_EXCL`), and says its inode; whatever is found under the
/// name is removed first, never followed, with a warning. No table when that
/// fails (a warning says why).
fn make<T: NodeTable>(name: &str, creation: &Creation) -> (Option<T>, Option<u64>) {
    let access = TableAccess::Fresh(*creation);
    let made = match T::open_named(name, &access) {
        Err(ActivityError::Exists { .. }) => {
            let found = std::fs::symlink_metadata(path(name)).map_or_else(
                |error| error.to_string(),
                |meta| {
                    format!(
                        "uid {} mode {:04o}, {} bytes",
                        meta.uid(),
                        meta.mode() & 0o7777,
                        meta.len()
                    )
                },
            );
            tracing::warn!(
                name,
                found,
                "replacing the node table found at start: nothing tells one this daemon made \
                 before a restart from one a pod planted (processes that mapped it keep it)"
            );
            if let Err(error) = crate::region::squat::remove(name) {
                tracing::warn!(%error, name, "cannot remove it: limited processes go without it");
                return (None, None);
            }
            T::open_named(name, &access)
        }
        made => made,
    };
    match made {
        Ok(table) => {
            let inode = std::fs::symlink_metadata(path(name))
                .ok()
                .map(|meta| meta.ino());
            (Some(table), inode)
        }
        Err(error) => {
            tracing::warn!(%error, name, "no node table: limited processes go without it");
            (None, None)
        }
    }
}
