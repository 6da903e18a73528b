//! The node's activity table: every limited pod stamps it when it launches,
//! so that elastic pods see whether another pod uses the device.

use std::sync::atomic::Ordering;

use gpushare_utils::activity::{self, MARK_INTERVAL_NS, NodeActivity};

use super::Throttle;
use crate::context::Context;

/// Names another node activity table (tests: one per test).
const NODE_REGION_VARIABLE: &str = "GPUSHARE_NODE_REGION";

impl Throttle {
    /// Stamps the node's activity table for `device`, at most every 10 ms.
    #[inline]
    pub(super) fn mark_active(&'static self, ctx: &'static Context, device: usize, now: u64) {
        let Some(marked) = self.marked_at_ns.get(device) else {
            return;
        };
        let last = marked.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= MARK_INTERVAL_NS {
            self.stamp_activity(ctx, device, now, last);
        }
    }

    #[cold]
    #[inline(never)]
    fn stamp_activity(&'static self, ctx: &'static Context, device: usize, now: u64, last: u64) {
        if self.marked_at_ns[device]
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return;
        }
        if let Some(table) = self.activity() {
            table.mark(device, self.pod_key(ctx), now);
        }
        self.start_monitor(ctx);
    }

    pub(super) fn activity(&self) -> Option<&NodeActivity> {
        self.activity
            .get_or_init(|| {
                let name = std::env::var(NODE_REGION_VARIABLE)
                    .unwrap_or_else(|_| activity::NODE_REGION.to_owned());
                NodeActivity::open_named(&name, &self.tables)
            }
            .map_or_else(
                |error| {
                    tracing::warn!(%error, "no node activity table: elastic pods stay at their share");
                    None
                },
                Some,
            ))
            .as_ref()
    }

    pub(super) fn pod_key(&self, ctx: &Context) -> u64 {
        *self
            .pod_key
            .get_or_init(|| activity::pod_key(ctx.pod.as_str()))
    }
}
