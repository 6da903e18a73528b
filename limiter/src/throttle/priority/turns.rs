//! A batch launch on a GPU whose pods take turns waits for its pod's turn
//! ([`gpushare_utils::priority::TurnLine`]): the GPU runs one pod's work at
//! a time, for a few milliseconds, instead of switching between processes
//! every few hundred microseconds.
//!
//! The GPU's line in the node's priority table is found by its UUID's key
//! (a container's device 0 is any of the node's GPUs). Under a hypervisor,
//! its `--turns-gpu` sets which GPUs take turns; without one,
//! [`super::tuning::TURN_VARIABLE`] does, for the GPUs this process
//! launches on. A pod out of budget passes its turn on: it cannot use it.
//!
//! Every limited process may write the line, so a launch believes it for a
//! round of turns at most ([`TurnLine::patience_ns`], counting the pods the
//! hypervisor says take turns there, which no pod can write): past that it
//! seizes a turn, which this process keeps for a quantum whatever the line
//! says meanwhile. A pod naming itself the holder without launching holds
//! its neighbours a round of turns for each of theirs, not for good.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};

use gpushare_utils::bucket::{CAPACITY_NS, monotonic_ns};
use gpushare_utils::limits::uuid_key;
use gpushare_utils::priority::{NodePriority, TurnLine, TurnStep};

use super::Priority;
use crate::context::Context;

/// Longest a launch waits for its turn: past it, the launch goes (the turn
/// is a way to share the GPU, not a limit; its budget still holds).
const TURN_WAIT_MAX_NS: u64 = 1_000_000_000;

/// A device's turn line, this pod's slot on it, and the GPU's key.
#[derive(Clone, Copy)]
pub(super) struct Seat {
    line: &'static TurnLine,
    slot: usize,
    gpu: u64,
}

/// Per device: the seat once found; until then, the GPU's key and when to
/// look again. And until when this process holds a turn it seized there.
pub(super) struct Seats {
    found: [OnceLock<Seat>; gpushare_utils::MAX_DEVICES],
    gpus: [OnceLock<u64>; gpushare_utils::MAX_DEVICES],
    look_again_at_ns: [AtomicU64; gpushare_utils::MAX_DEVICES],
    seized_until_ns: [AtomicU64; gpushare_utils::MAX_DEVICES],
}

impl Seats {
    pub(super) const fn new() -> Self {
        Self {
            found: [const { OnceLock::new() }; gpushare_utils::MAX_DEVICES],
            gpus: [const { OnceLock::new() }; gpushare_utils::MAX_DEVICES],
            look_again_at_ns: [const { AtomicU64::new(0) }; gpushare_utils::MAX_DEVICES],
            seized_until_ns: [const { AtomicU64::new(0) }; gpushare_utils::MAX_DEVICES],
        }
    }
}

impl Priority {
    /// Waits for this pod's turn on `device`, where its GPU takes turns, and
    /// returns the time then; returns `now` at once elsewhere (a load, once
    /// the GPU's line is known: its quantum).
    pub(super) fn take_turn(
        &self,
        ctx: &'static Context,
        table: &NodePriority,
        device: usize,
        now: u64,
    ) -> u64 {
        let (Some(seat), Some(seized)) = (
            self.seat(ctx, table, device, now),
            self.seats.seized_until_ns.get(device),
        ) else {
            return now;
        };
        if now < seized.load(Ordering::Relaxed) {
            // A turn this process seized: the line may name another holder.
            seat.line.want(seat.slot, now);
            return now;
        }
        let deadline = now.saturating_add(TURN_WAIT_MAX_NS);
        let mut patient_until = None;
        let mut at = now;
        loop {
            match seat.line.take(seat.slot, at) {
                TurnStep::Go => return at,
                TurnStep::Wait { wake, until_ns } => {
                    let patient = *patient_until.get_or_insert_with(|| {
                        let pods = ctx
                            .hypervisor_limits()
                            .and_then(|limits| limits.turn_pods(seat.gpu))
                            .unwrap_or(0);
                        now.saturating_add(seat.line.patience_ns(pods, at))
                    });
                    if at >= patient {
                        // Round robin would have served it by now: the line
                        // is held by a writer that does not hand it on.
                        seized.store(seat.line.seize(seat.slot, at), Ordering::Relaxed);
                        tracing::debug!(device, "waited a round of turns: took one");
                        return at;
                    }
                    seat.line.wait(wake, until_ns.min(patient).min(deadline));
                }
            }
            at = monotonic_ns();
            if at >= deadline {
                tracing::debug!(device, "launch waited its longest for a turn");
                return at;
            }
        }
    }

    /// When this pod's turn on `device` began, where the GPU takes turns
    /// and the pod holds an unexpired one at `now` (see
    /// [`TurnLine::held_since`]); `None` otherwise.
    pub(crate) fn turn_held_since(&self, device: usize, now: u64) -> Option<u64> {
        let seat = self.seats.found.get(device)?.get()?;
        seat.line.held_since(seat.slot, now)
    }

    /// How deep this pod's bucket on `device` is: a turn, where the GPU
    /// takes turns longer than the default depth (so that a pod banks what
    /// it earns while the others hold theirs, and can use its own), once its
    /// seat is found; else [`CAPACITY_NS`]. A few loads.
    #[inline]
    pub(crate) fn bank_ns(&self, device: usize) -> i64 {
        self.seats
            .found
            .get(device)
            .and_then(OnceLock::get)
            .map_or(CAPACITY_NS, |seat| {
                i64::try_from(seat.line.quantum_ns())
                    .map_or(CAPACITY_NS, |turn| turn.max(CAPACITY_NS))
            })
    }

    /// This pod cannot launch on `device` for a while (no budget): hands its
    /// turn there, if it holds one, to the next pod that wants one.
    pub(crate) fn pass_turn(&self, device: usize) {
        if let Some(seat) = self.seats.found.get(device).and_then(OnceLock::get) {
            if let Some(seized) = self.seats.seized_until_ns.get(device) {
                seized.store(0, Ordering::Relaxed);
            }
            seat.line.pass(seat.slot, monotonic_ns());
        }
    }

    /// This pod's seat on `device`'s turn line: found by the GPU's UUID (and
    /// claimed, with the quantum of [`super::tuning::TURN_VARIABLE`], by a
    /// process that sets it without a hypervisor), or `None` (looked for
    /// again at most every [`super::LOOK_AGAIN_NS`]).
    fn seat(
        &self,
        ctx: &'static Context,
        table: &NodePriority,
        device: usize,
        now: u64,
    ) -> Option<Seat> {
        let cell = self.seats.found.get(device)?;
        if let Some(seat) = cell.get() {
            return Some(*seat);
        }
        let look_again = self.seats.look_again_at_ns.get(device)?;
        if now < look_again.load(Ordering::Relaxed) {
            return None;
        }
        look_again.store(now.saturating_add(super::LOOK_AGAIN_NS), Ordering::Relaxed);
        let gpu = match self.seats.gpus.get(device)?.get() {
            Some(gpu) => *gpu,
            None => {
                let uuid = ctx.driver()?.device_uuid(i32::try_from(device).ok()?)?;
                *self.seats.gpus.get(device)?.get_or_init(|| uuid_key(&uuid))
            }
        };
        let local_quantum = self.tuning.turn_us;
        let line = if local_quantum > 0 && ctx.hypervisor_limits().is_none() {
            let line = table.claim_turn_line(gpu)?;
            if line.quantum_us.load(Ordering::Relaxed) != local_quantum {
                line.set_quantum_us(local_quantum);
            }
            line
        } else {
            table.turn_line(gpu)?
        };
        let slot = line.slot(self.pod_key, now)?;
        tracing::debug!(device, slot, "turn line found");
        Some(*cell.get_or_init(|| Seat { line, slot, gpu }))
    }
}
