//! Memory the driver takes through calls that name no size: measured,
//! pending, or (graph allocation nodes) held from instantiation.

use std::sync::atomic::Ordering;

use gpushare_utils::ledger::PodLedger;

use super::{GraphParts, MemoryQuota, Resource, refusal};
use crate::context::Context;
use crate::error::{LimiterError, Result};
use crate::sys::CUresult;

impl MemoryQuota {
    /// Runs `op`, which makes the driver take memory on `device` that no
    /// call names (about `estimate` bytes; 0 when unknown): the estimate is
    /// reserved first, the process measured right after, and when the pod
    /// ends over its quota `undo` gives the memory back and the call is
    /// refused. Where NVML cannot measure, the estimate stays charged.
    pub(crate) fn measured(
        &self,
        ctx: &'static Context,
        device: usize,
        estimate: u64,
        op: impl FnOnce() -> CUresult,
        undo: impl FnOnce(),
    ) -> Result<CUresult> {
        let (ledger, entry, limit) = self.reservable(ctx, device, estimate)?;
        self.measure_overhead(ctx, device, false);
        let held = raise_overhead(ledger, entry, device, limit, estimate)?;
        let result = op();
        if !result.is_success() {
            let _ = ledger.set_overhead(entry, held);
            return Ok(result);
        }
        self.measure_overhead(ctx, device, true);
        let used = ledger.usage(entry).map_or(0, |usage| usage.used);
        if used <= limit {
            return Ok(result);
        }
        let taken = ledger
            .process_overhead(entry)
            .unwrap_or(0)
            .saturating_sub(held);
        undo();
        if !self.measure_overhead(ctx, device, true) {
            let _ = ledger.set_overhead(entry, held);
        }
        tracing::debug!(device, taken, used, limit, "driver-held memory refused");
        Err(LimiterError::OverQuota {
            device,
            requested: taken,
            used: used.saturating_sub(taken),
            quota: limit,
        })
    }

    /// Runs `op`, after which the driver takes `bytes` more on `device` at
    /// the process's next launch (the malloc heap): reserved now, and
    /// pending until the process's footprint has grown by them.
    pub(crate) fn pending(
        &self,
        ctx: &'static Context,
        device: usize,
        bytes: u64,
        op: impl FnOnce() -> CUresult,
    ) -> Result<CUresult> {
        let (ledger, entry, limit) = self.reservable(ctx, device, bytes)?;
        self.measure_overhead(ctx, device, true);
        let held = raise_overhead(ledger, entry, device, limit, bytes)?;
        let seen = self.seen(ctx, device);
        let result = op();
        if !result.is_success() {
            let _ = ledger.set_overhead(entry, held);
            return Ok(result);
        }
        if self.pending[device].fetch_add(bytes, Ordering::AcqRel) == 0 {
            // Without NVML nothing is measured: the reservation stays as is.
            self.pending_base[device].store(seen.unwrap_or(u64::MAX), Ordering::Release);
        }
        Ok(result)
    }

    /// Reserves what a graph's allocation nodes take (`(device, bytes)`),
    /// beyond what each device's graph pool holds unneeded already.
    pub(crate) fn graph_holds(
        &self,
        ctx: &'static Context,
        needs: &[(usize, u64)],
    ) -> Result<GraphHold<'_>> {
        let mut hold = GraphHold {
            quota: self,
            ctx,
            parts: Vec::with_capacity(needs.len()),
        };
        for &(device, bytes) in needs {
            let (ledger, entry, limit) = self.reservable(ctx, device, bytes)?;
            self.measure_overhead(ctx, device, false);
            let spare = self
                .graph_reserved(ctx, device)
                .unwrap_or(0)
                .saturating_sub(self.graph_need[device].load(Ordering::Acquire));
            let rise = bytes.saturating_sub(spare);
            raise_overhead(ledger, entry, device, limit, rise)?;
            self.graph_need[device].fetch_add(bytes, Ordering::AcqRel);
            hold.parts.push((device, bytes, rise));
        }
        Ok(hold)
    }

    /// Ends a graph exec's charge; what its nodes took stays with the
    /// device's graph pool, and is measured, until it is trimmed.
    pub(crate) fn end_graph(&self, ctx: &'static Context, exec: Resource) {
        let parts = self
            .graph_execs
            .lock()
            .ok()
            .and_then(|mut execs| execs.remove(&exec));
        for (device, bytes, _) in parts.unwrap_or_default() {
            let _ =
                self.graph_need[device].fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    Some(n.saturating_sub(bytes))
                });
        }
        self.remeasure(ctx);
    }
}

/// Raises this process's driver overhead on ledger entry `entry` (CUDA
/// device `device`) by `bytes`, reserved against `limit` like an
/// allocation: memory the driver is about to take is counted before it is
/// taken. Returns the overhead before, to give the rise back with.
pub(crate) fn raise_overhead(
    ledger: &PodLedger,
    entry: usize,
    device: usize,
    limit: u64,
    bytes: u64,
) -> Result<u64> {
    let held = ledger.process_overhead(entry).unwrap_or(0);
    ledger
        .try_raise_overhead_under(entry, held.saturating_add(bytes), limit)
        .map_err(|error| refusal(device, error))?;
    Ok(held)
}

/// What a graph's allocation nodes reserve until its exec is made; given
/// back on drop unless committed.
pub(crate) struct GraphHold<'a> {
    quota: &'a MemoryQuota,
    ctx: &'static Context,
    parts: GraphParts,
}

impl GraphHold<'_> {
    /// Keeps the reservation as the charge of the exec `exec`.
    pub(crate) fn commit(mut self, exec: Resource) {
        if let Ok(mut execs) = self.quota.graph_execs.lock() {
            execs.insert(exec, std::mem::take(&mut self.parts));
        }
    }
}

impl Drop for GraphHold<'_> {
    fn drop(&mut self) {
        let Some(ledger) = self.ctx.ledger() else {
            return;
        };
        for &(device, bytes, rise) in &self.parts {
            let _ = self.quota.graph_need[device].fetch_update(
                Ordering::AcqRel,
                Ordering::Acquire,
                |n| Some(n.saturating_sub(bytes)),
            );
            if let Some(entry) = self.ctx.ledger_entry(device) {
                let held = ledger.process_overhead(entry).unwrap_or(0);
                let _ = ledger.set_overhead(entry, held.saturating_sub(rise));
            }
        }
    }
}
