//! What this process's driver-held memory is: measured through NVML, plus
//! what the driver is yet to take (see the module's rules).

use std::sync::atomic::Ordering;

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::bucket::monotonic_ns;

use super::{MemoryQuota, OVERHEAD_REFRESH_MS};
use crate::context::Context;

impl MemoryQuota {
    /// Charges what NVML attributes to this process on `device` beyond its
    /// accounted allocations, plus what the driver is yet to take (pending
    /// heap, graph nodes not uploaded). Rate-limited unless `force`; false
    /// when nothing was measured.
    pub(crate) fn measure_overhead(
        &self,
        ctx: &'static Context,
        device: usize,
        force: bool,
    ) -> bool {
        let Some(last) = self.overhead_measured_ms.get(device) else {
            return false;
        };
        // Milliseconds of the node's monotonic clock; 0 means never measured.
        let now = monotonic_ns() / 1_000_000 + 1;
        let previous = last.load(Ordering::Relaxed);
        let before = self.changes.snapshot();
        let settle = before.0 == 0 && self.overhead_unsettled[device].load(Ordering::Relaxed);
        if !force && !settle && previous != 0 && now.saturating_sub(previous) < OVERHEAD_REFRESH_MS
        {
            return false;
        }
        if last
            .compare_exchange(previous, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_err()
        {
            return false; // another thread is measuring
        }
        let Some(uuid) = ctx.device_uuid(device) else {
            return false;
        };
        let (Some(ledger), Some(entry)) = (ctx.ledger(), ctx.ledger_entry_of(&uuid)) else {
            return false;
        };
        let Some(seen) = ctx
            .nvml()
            .and_then(|nvml| nvml.process_used(&uuid, std::process::id()))
        else {
            return false;
        };
        let allocated = ledger.process_usage(entry).unwrap_or(0);
        let overhead = seen
            .saturating_sub(allocated)
            .max(self.context_floor[device].load(Ordering::Relaxed))
            .saturating_add(self.unseen_pending(device, seen))
            .saturating_add(self.unseen_graphs(ctx, device));
        let clean = before.0 == 0 && self.changes.snapshot() == before;
        self.overhead_unsettled[device].store(!clean, Ordering::Relaxed);
        // A change under way made the overhead look smaller by its bytes
        // (reserved and not yet allocated, or freed and not yet credited):
        // believed only where it raises the overhead.
        if !clean && overhead <= ledger.process_overhead(entry).unwrap_or(0) {
            tracing::trace!(
                device,
                seen,
                overhead,
                "overhead measured during a change: kept"
            );
            return true;
        }
        match ledger.set_overhead(entry, overhead) {
            Ok(()) => tracing::debug!(device, seen, overhead, "driver overhead measured"),
            Err(error) => tracing::warn!(device, %error, "driver overhead not recorded"),
        }
        true
    }

    /// This process's footprint on `device` as NVML sees it.
    pub(super) fn seen(&self, ctx: &'static Context, device: usize) -> Option<u64> {
        let uuid = ctx.device_uuid(device)?;
        ctx.nvml()?.process_used(&uuid, std::process::id())
    }

    /// Heap growth the footprint `seen` does not show yet; forgotten once
    /// it does.
    fn unseen_pending(&self, device: usize, seen: u64) -> u64 {
        let pending = self.pending[device].load(Ordering::Acquire);
        if pending == 0 {
            return 0;
        }
        let base = self.pending_base[device].load(Ordering::Acquire);
        if seen >= base.saturating_add(pending) {
            let _ = self.pending[device].compare_exchange(
                pending,
                0,
                Ordering::AcqRel,
                Ordering::Acquire,
            );
            return 0;
        }
        pending
    }

    /// What live graph execs need on `device` beyond what its graph pool
    /// holds already.
    fn unseen_graphs(&self, ctx: &'static Context, device: usize) -> u64 {
        let need = self.graph_need[device].load(Ordering::Acquire);
        if need == 0 {
            return 0;
        }
        need.saturating_sub(self.graph_reserved(ctx, device).unwrap_or(0))
    }

    pub(super) fn graph_reserved(&self, ctx: &'static Context, device: usize) -> Option<u64> {
        ctx.driver()?
            .held
            .graph_reserved(i32::try_from(device).ok()?)
    }

    /// Records what this process's contexts on `device` hold (0: none).
    pub(crate) fn set_context_floor(&self, device: usize, bytes: u64) {
        if let Some(floor) = self.context_floor.get(device) {
            floor.store(bytes, Ordering::Relaxed);
        }
    }

    /// Measures every device measured before again, now: the driver may
    /// hold less.
    pub(crate) fn remeasure(&self, ctx: &'static Context) {
        for device in 0..MAX_DEVICES {
            if self.overhead_measured_ms[device].load(Ordering::Relaxed) != 0
                && !self.measure_overhead(ctx, device, true)
            {
                self.overhead_unsettled[device].store(true, Ordering::Relaxed);
            }
        }
    }
}
