//! What a pod's process is told of a limited device's memory: the quota
//! as its total, what is left of it as free, never more than the device
//! really has; the pod's dead processes' charges given back first.

use std::sync::atomic::Ordering;

use gpushare_utils::bucket::monotonic_ns;
use gpushare_utils::ledger::PodLedger;

use super::{MemoryQuota, REPORT_RECLAIM_MS};
use crate::context::Context;

impl MemoryQuota {
    /// The memory report of a limited device: `(free, total)` from the real
    /// ones, or `None` when the device is unlimited.
    pub(crate) fn report(
        &self,
        ctx: &'static Context,
        device: usize,
        real_free: u64,
        real_total: u64,
    ) -> Option<(u64, u64)> {
        let limit = self.limit(ctx, device)?;
        self.measure_overhead(ctx, device, false);
        let used = ctx
            .ledger_entry(device)
            .map_or(0, |entry| self.pod_used(ctx, entry))
            .saturating_add(self.unaccounted(ctx, device));
        Some(virtual_report(limit, used, real_free, real_total))
    }

    /// Pod usage of ledger entry `entry` (see [`Context::ledger_entry_of`]),
    /// after giving back what dead processes held, this process's pools
    /// charged what they hold now.
    pub(crate) fn pod_used(&self, ctx: &'static Context, entry: usize) -> u64 {
        let Some(ledger) = ctx.ledger() else {
            return 0;
        };
        self.settle_pools(ctx);
        self.reclaim_before_report(ledger);
        ledger.usage(entry).map_or(0, |usage| usage.used)
    }

    /// Scans for dead processes, at most every [`REPORT_RECLAIM_MS`].
    fn reclaim_before_report(&self, ledger: &PodLedger) {
        let now = monotonic_ns() / 1_000_000 + 1;
        let last = self.reclaimed_ms.load(Ordering::Relaxed);
        if last != 0 && now.saturating_sub(last) < REPORT_RECLAIM_MS {
            return;
        }
        if self
            .reclaimed_ms
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            let bytes = ledger.reclaim_dead();
            if bytes > 0 {
                tracing::debug!(bytes, "dead processes' memory given back before a report");
            }
        }
    }
}

/// `(free, total)` as a pod with `limit` and `used` should see a device that
/// really has `real_free` of `real_total`.
pub(crate) fn virtual_report(limit: u64, used: u64, real_free: u64, real_total: u64) -> (u64, u64) {
    let total = limit.min(real_total);
    let free = total.saturating_sub(used).min(real_free);
    (free, total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_never_underflows_nor_exceeds_real_free() {
        let gib = 1u64 << 30;
        let cases = [
            // limit, used, real free, real total => free, total
            (4 * gib, 0, 70 * gib, 80 * gib, 4 * gib, 4 * gib),
            (4 * gib, gib, 70 * gib, 80 * gib, 3 * gib, 4 * gib),
            (4 * gib, 5 * gib, 70 * gib, 80 * gib, 0, 4 * gib),
            (4 * gib, gib, 2 * gib, 80 * gib, 2 * gib, 4 * gib),
            (100 * gib, 0, 70 * gib, 80 * gib, 70 * gib, 80 * gib),
        ];
        for (limit, used, real_free, real_total, free, total) in cases {
            assert_eq!(
                virtual_report(limit, used, real_free, real_total),
                (free, total),
                "limit {limit} used {used} real {real_free}/{real_total}"
            );
        }
    }
}
