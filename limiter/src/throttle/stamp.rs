//! The node's activity table: every limited pod stamps it when it launches,
//! so that elastic pods see whether another pod uses the device.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::activity::{MARK_INTERVAL_NS, NodeActivity};
use gpushare_utils::node_table::{self, NodeTable, TableAccess};

use crate::context::Context;

/// This process's stamps in the node's activity table, and the table.
pub(super) struct Stamps {
    /// How the node's activity table is mapped, and its name.
    tables: TableAccess,
    name: String,
    activity: OnceLock<Option<NodeActivity>>,
    pod_key: OnceLock<u64>,
    /// When this process last stamped each device.
    marked_at_ns: [AtomicU64; MAX_DEVICES],
}

impl Stamps {
    pub(super) fn new(tables: TableAccess, name: String) -> Self {
        Self {
            tables,
            name,
            activity: OnceLock::new(),
            pod_key: OnceLock::new(),
            marked_at_ns: [const { AtomicU64::new(0) }; MAX_DEVICES],
        }
    }

    /// When `device` was last stamped, if a stamp is due at `now` (at most
    /// one every [`MARK_INTERVAL_NS`]).
    #[inline]
    pub(super) fn due(&self, device: usize, now: u64) -> Option<u64> {
        let last = self.marked_at_ns.get(device)?.load(Ordering::Relaxed);
        (now.saturating_sub(last) >= MARK_INTERVAL_NS).then_some(last)
    }

    /// Stamps `device` at `now` if no other thread did since `last`; true
    /// when this call took the stamp.
    #[cold]
    #[inline(never)]
    pub(super) fn stamp(&self, ctx: &Context, device: usize, now: u64, last: u64) -> bool {
        let Some(marked) = self.marked_at_ns.get(device) else {
            return false;
        };
        if marked
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false;
        }
        if let Some(table) = self.activity() {
            table.mark(device, self.pod_key(ctx), now);
        }
        true
    }

    /// Whether another pod launched on `device` recently; false without a
    /// table.
    pub(super) fn contended(&self, ctx: &Context, device: usize, now: u64) -> bool {
        self.activity()
            .is_some_and(|table| table.contended(device, self.pod_key(ctx), now))
    }

    /// The node's activity table, opened at its first use; none while its
    /// header is wrong (every pod may write it): then, as without a table,
    /// nothing is stamped and no other pod is seen.
    pub(super) fn activity(&self) -> Option<&NodeActivity> {
        self.activity
            .get_or_init(|| {
                NodeActivity::open_named(&self.name, &self.tables)
            }
            .map_or_else(
                |error| {
                    tracing::warn!(%error, "no node activity table: elastic pods stay at their share");
                    None
                },
                Some,
            ))
            .as_ref()
            .filter(|table| table.is_sound())
    }

    fn pod_key(&self, ctx: &Context) -> u64 {
        *self
            .pod_key
            .get_or_init(|| node_table::pod_key(ctx.pod.as_str()))
    }
}
