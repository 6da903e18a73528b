//! Turns on a time-sliced GPU: the batch pods of a GPU that takes turns
//! launch one pod at a time, each for a turn of a few milliseconds.
//!
//! The GPU time-slices between the contexts of processes that all have work
//! queued, switching every few hundred microseconds when each keeps only a
//! step or two queued (a host-synchronised loop); on an H100 that cost about
//! a tenth of the GPU and served such processes unevenly. While pods take
//! turns, the GPU runs one pod's work for a whole turn.
//!
//! A [`TurnLine`] per GPU (found by its [`uuid_key`], not by a process's
//! device ordinal, which is 0 in every one-GPU container) keeps the turn in
//! one word: the holder's slot and when its turn ends. Each pod has a slot
//! that its processes stamp while they want to launch there. A launch:
//! - goes on when its pod holds an unexpired turn (a few loads);
//! - at its pod's turn's end hands the turn to the next pod after it (slot
//!   order, round robin) that wants one, or keeps it when none does;
//! - otherwise waits (a futex on [`TurnLine::wake`], bumped at every change
//!   of the turn) until the turn is handed over; it takes the turn over,
//!   for the next pod that wants it, when the holder's turn ended more than
//!   [`IDLE_NS`] ago, or its pod stopped wanting (it went idle, ran out of
//!   budget or died: no stamp for [`IDLE_NS`]).
//!
//! The line is in the priority table, which every limited process may
//! write: a turn no writer of this node could have written (a holder past
//! the slots, an end further ahead than a turn) reads as ended, and a turn
//! is at most [`MAX_QUANTUM_US`]. A writer can also name itself (or any
//! slot) the holder again and again without launching, so a waiting launch
//! does not believe the line for ever: round robin serves it within a turn
//! of each other pod that takes turns, so once it has waited
//! [`TurnLine::patience_ns`] by its own clock (the pods counted by the
//! daemon, which a pod cannot write, or else those wanting a turn) it
//! [`seizes`](TurnLine::seize) a turn, which its process keeps for a
//! quantum whatever the line says meanwhile. A pod that writes the line can
//! thus make others wait at most a round of turns for each of theirs, or
//! drop turns (time slicing again); it never raises a limit.
//!
//! [`uuid_key`]: crate::limits::uuid_key

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use crate::node_table::{FUTURE_SLACK_NS, PODS_PER_DEVICE, plausible_stamp, pod_slot};

/// A holder's pod is idle when none of its processes stamped its slot for
/// this long (a host-synchronised loop launches every few hundred µs).
pub const IDLE_NS: u64 = 1_000_000;
/// A waiting pod wants a turn while its slot's stamp is this recent; its
/// waiting processes stamp it every [`WAIT_SLICE_NS`].
pub const WANT_NS: u64 = 8_000_000;
/// A waiting process wakes at least this often to stamp its pod's slot and
/// look whether the holder went idle.
pub const WAIT_SLICE_NS: u64 = 2_000_000;
/// A launching process stamps its slot at most this often.
const STAMP_REFRESH_NS: u64 = 100_000;
/// The longest turn, whatever the line says.
pub const MAX_QUANTUM_US: u32 = 100_000;
/// A slot not stamped for this long may be taken by another pod.
const STALE_NS: u64 = 600_000_000_000;
/// The turn word: holder slot + 1 above this shift, the end (µs) below.
const HOLDER_SHIFT: u32 = 56;
const END_MASK: u64 = (1 << HOLDER_SHIFT) - 1;

/// One pod's slot on a GPU that takes turns.
#[repr(C)]
#[derive(Debug, Default)]
pub struct TurnSlot {
    /// [`crate::node_table::pod_key`] of the pod; 0 = free.
    pub pod: AtomicU64,
    /// When a process of the pod last wanted to launch on the GPU.
    pub wanting_at_ns: AtomicU64,
}

/// The turns of one GPU.
#[repr(C)]
pub struct TurnLine {
    /// [`crate::limits::uuid_key`] of the GPU; 0 = free line.
    pub gpu: AtomicU64,
    /// The turn: the holder's slot plus one in the top 8 bits (0: nobody),
    /// the end of its turn in the low 56 (µs of `CLOCK_MONOTONIC`).
    pub turn: AtomicU64,
    /// How long a turn lasts, µs; 0: the GPU does not take turns.
    pub quantum_us: AtomicU32,
    /// Bumped at every change of [`Self::turn`]: what waiters sleep on.
    pub wake: AtomicU32,
    /// Turns handed from one pod to another since the line was claimed.
    pub handovers: AtomicU64,
    /// Unused; zero.
    pub reserved: [AtomicU64; 4],
    /// Per pod, its stamp.
    pub slots: [TurnSlot; PODS_PER_DEVICE],
}

const _: () = assert!(size_of::<TurnSlot>() == 16);
const _: () = assert!(std::mem::offset_of!(TurnLine, slots) == 64);
const _: () = assert!(size_of::<TurnLine>() == 64 + 16 * PODS_PER_DEVICE);
const _: () = assert!(
    PODS_PER_DEVICE < 255,
    "a slot plus one fits the holder's byte"
);

/// What a launch does about the turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnStep {
    /// Its pod holds the turn (or the GPU takes none): launch.
    Go,
    /// Another pod holds it: [`TurnLine::wait`] with these, then ask again.
    Wait {
        /// [`TurnLine::wake`] as read before the turn.
        wake: u32,
        /// Wait no later than this (ns).
        until_ns: u64,
    },
}

/// A line's turn as a reader may believe it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Turn {
    holder: Option<usize>,
    end_us: u64,
}

impl Turn {
    fn decode(word: u64, now_us: u64, quantum_us: u64) -> Self {
        let holder = usize::try_from(word >> HOLDER_SHIFT)
            .ok()
            .and_then(|slot| slot.checked_sub(1))
            .filter(|&slot| slot < PODS_PER_DEVICE);
        let end_us = word & END_MASK;
        // An end further ahead than one turn (and a clock read's slack) was
        // written by nobody's clock.
        let latest_us = now_us.saturating_add(quantum_us + FUTURE_SLACK_NS / 1_000);
        if holder.is_none() || end_us > latest_us {
            return Self {
                holder: None,
                end_us: 0,
            };
        }
        Self { holder, end_us }
    }

    fn encode(holder: usize, end_us: u64) -> u64 {
        (holder as u64 + 1) << HOLDER_SHIFT | end_us & END_MASK
    }
}

impl TurnLine {
    /// How long a turn lasts (ns), at most [`MAX_QUANTUM_US`]; 0: the GPU
    /// does not take turns.
    #[inline]
    pub fn quantum_ns(&self) -> u64 {
        u64::from(self.quantum_us.load(Ordering::Acquire).min(MAX_QUANTUM_US)) * 1_000
    }

    /// Sets the length of a turn (µs; 0: no turns). Dropping turns hands the
    /// turn back, so that nobody waits for it.
    pub fn set_quantum_us(&self, quantum_us: u32) {
        self.quantum_us
            .store(quantum_us.min(MAX_QUANTUM_US), Ordering::Release);
        if quantum_us == 0 && self.turn.swap(0, Ordering::AcqRel) != 0 {
            self.bump();
        }
    }

    /// The slot of `pod` (found, or claimed, and stamped, when it has none);
    /// `None` when every slot is taken by a pod seen within [`STALE_NS`].
    pub fn slot(&self, pod: u64, now_ns: u64) -> Option<usize> {
        let (index, claimed) = pod_slot(&self.slots, pod, now_ns, STALE_NS, |slot| {
            (&slot.pod, &slot.wanting_at_ns)
        })?;
        if claimed {
            // Claimed by a launch: the pod wants a turn.
            self.slots[index]
                .wanting_at_ns
                .store(now_ns, Ordering::Release);
        }
        Some(index)
    }

    /// Stamps `slot` as wanting at `now_ns` (at most every
    /// [`STAMP_REFRESH_NS`]).
    #[inline]
    pub fn want(&self, slot: usize, now_ns: u64) {
        if let Some(slot) = self.slots.get(slot) {
            let stamped = slot.wanting_at_ns.load(Ordering::Relaxed);
            if now_ns.saturating_sub(stamped) >= STAMP_REFRESH_NS
                || !plausible_stamp(stamped, now_ns)
            {
                slot.wanting_at_ns.store(now_ns, Ordering::Release);
            }
        }
    }

    /// Whether `slot`'s pod stamped it within `within_ns` of `now_ns`.
    fn wanting(&self, slot: usize, now_ns: u64, within_ns: u64) -> bool {
        self.slots.get(slot).is_some_and(|slot| {
            let stamped = slot.wanting_at_ns.load(Ordering::Acquire);
            slot.pod.load(Ordering::Relaxed) != 0
                && stamped != 0
                && plausible_stamp(stamped, now_ns)
                && now_ns.saturating_sub(stamped) < within_ns
        })
    }

    /// Whether the pod in `holder` still holds `turn` at `now_ns`: its turn
    /// ended less than [`IDLE_NS`] ago, and it stamped its slot within
    /// [`IDLE_NS`] (or its turn began that recently: a waiter handed the
    /// turn stamps it when it wakes).
    fn holding(&self, holder: usize, turn: Turn, now_ns: u64, quantum_us: u64) -> bool {
        let began_ns = turn.end_us.saturating_sub(quantum_us).saturating_mul(1_000);
        now_ns / 1_000 < turn.end_us.saturating_add(IDLE_NS / 1_000)
            && (self.wanting(holder, now_ns, IDLE_NS) || now_ns.saturating_sub(began_ns) < IDLE_NS)
    }

    /// The first slot after `after` (round robin, `after` itself last) whose
    /// pod wants a turn; `None` when none does.
    fn next_wanting(&self, after: usize, now_ns: u64) -> Option<usize> {
        (1..=PODS_PER_DEVICE)
            .map(|k| (after + k) % PODS_PER_DEVICE)
            .find(|&slot| self.wanting(slot, now_ns, WANT_NS))
    }

    /// What a launch of the pod in `slot` at `now_ns` does: go, or wait for
    /// its turn. Stamps the slot; hands the turn over where its holder's
    /// turn ended or its pod stopped wanting.
    pub fn take(&self, slot: usize, now_ns: u64) -> TurnStep {
        let quantum_ns = self.quantum_ns();
        if quantum_ns == 0 || slot >= PODS_PER_DEVICE {
            return TurnStep::Go;
        }
        self.want(slot, now_ns);
        let (now_us, quantum_us) = (now_ns / 1_000, quantum_ns / 1_000);
        loop {
            // The wake count before the turn: a change after this read bumps
            // it, and the wait returns at once.
            let wake = self.wake.load(Ordering::Acquire);
            let word = self.turn.load(Ordering::Acquire);
            let turn = Turn::decode(word, now_us, quantum_us);
            let next = match turn.holder {
                Some(holder) if holder == slot => {
                    if now_us < turn.end_us {
                        return TurnStep::Go;
                    }
                    // Its turn ended: the next pod that wants one, or again.
                    self.next_wanting(slot, now_ns).unwrap_or(slot)
                }
                Some(holder) if self.holding(holder, turn, now_ns, quantum_us) => {
                    let end_ns = turn.end_us.saturating_mul(1_000).saturating_add(IDLE_NS);
                    return TurnStep::Wait {
                        wake,
                        until_ns: end_ns.min(now_ns.saturating_add(WAIT_SLICE_NS)),
                    };
                }
                // Nobody's, long ended, or its pod stopped wanting: the next
                // pod after the holder that wants it (this one at least).
                Some(holder) => self.next_wanting(holder, now_ns).unwrap_or(slot),
                None => self.next_wanting(slot, now_ns).unwrap_or(slot),
            };
            let handed = Turn::encode(next, now_us.saturating_add(quantum_us));
            if self
                .turn
                .compare_exchange(word, handed, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
            {
                if turn.holder.is_some_and(|holder| holder != next) {
                    self.handovers.fetch_add(1, Ordering::Relaxed);
                }
                self.bump();
                if next == slot {
                    return TurnStep::Go;
                }
            }
        }
    }

    /// When the turn that the pod in `slot` holds at `now_ns` began (ns of
    /// `CLOCK_MONOTONIC`); `None` when it holds none then, or its turn has
    /// ended. No other pod of the line launches while it holds one, and a
    /// turn handed on or taken again begins anew: a launch made after this
    /// time, read while the pod still holds the turn, ran beside no kernel
    /// of theirs queued since.
    pub fn held_since(&self, slot: usize, now_ns: u64) -> Option<u64> {
        let quantum_us = self.quantum_ns() / 1_000;
        if quantum_us == 0 {
            return None;
        }
        let now_us = now_ns / 1_000;
        let turn = Turn::decode(self.turn.load(Ordering::Acquire), now_us, quantum_us);
        (turn.holder == Some(slot) && now_us < turn.end_us)
            .then(|| turn.end_us.saturating_sub(quantum_us).saturating_mul(1_000))
    }

    /// How long a launch of a pod waits for its turn before it takes one
    /// anyway ([`Self::seize`]), at `now_ns`: a turn (and the [`IDLE_NS`] a
    /// waiter gives a holder past its end) for each other of `pods`, the
    /// pods taking turns on the GPU, plus [`IDLE_NS`]. Round robin hands a
    /// pod that wants a turn its own within that; only a holder that
    /// renames itself without launching keeps it longer. `pods` 0 (nobody
    /// counted them) is those wanting a turn now, this one included.
    pub fn patience_ns(&self, pods: usize, now_ns: u64) -> u64 {
        let pods = if pods == 0 {
            (0..PODS_PER_DEVICE)
                .filter(|&slot| self.wanting(slot, now_ns, WANT_NS))
                .count()
        } else {
            pods
        };
        let others = u64::try_from(pods.clamp(1, PODS_PER_DEVICE) - 1).unwrap_or(0);
        others
            .saturating_mul(self.quantum_ns() + IDLE_NS)
            .saturating_add(IDLE_NS)
    }

    /// Takes the turn for the pod in `slot` at `now_ns` whatever the line
    /// says (it waited [`Self::patience_ns`] in vain), wakes the waiters,
    /// and returns when the turn ends (ns): the caller holds it until then,
    /// even where a writer names another holder meanwhile. 0: the GPU takes
    /// no turns.
    pub fn seize(&self, slot: usize, now_ns: u64) -> u64 {
        let quantum_ns = self.quantum_ns();
        if quantum_ns == 0 || slot >= PODS_PER_DEVICE {
            return 0;
        }
        let end_us = now_ns.saturating_add(quantum_ns) / 1_000;
        let before = self.turn.swap(Turn::encode(slot, end_us), Ordering::AcqRel);
        let before = Turn::decode(before, now_ns / 1_000, quantum_ns / 1_000);
        if before.holder.is_some_and(|holder| holder != slot) {
            self.handovers.fetch_add(1, Ordering::Relaxed);
        }
        self.bump();
        end_us.saturating_mul(1_000)
    }

    /// The pod in `slot` cannot use its turn now (out of budget): hands it
    /// to the next pod that wants one, if it holds it and another does.
    pub fn pass(&self, slot: usize, now_ns: u64) {
        let quantum_us = self.quantum_ns() / 1_000;
        if quantum_us == 0 {
            return;
        }
        let now_us = now_ns / 1_000;
        let word = self.turn.load(Ordering::Acquire);
        if Turn::decode(word, now_us, quantum_us).holder != Some(slot) {
            return;
        }
        let Some(next) = self.next_wanting(slot, now_ns).filter(|&next| next != slot) else {
            return;
        };
        let handed = Turn::encode(next, now_us.saturating_add(quantum_us));
        if self
            .turn
            .compare_exchange(word, handed, Ordering::AcqRel, Ordering::Relaxed)
            .is_ok()
        {
            self.handovers.fetch_add(1, Ordering::Relaxed);
            self.bump();
        }
    }

    /// Sleeps until the turn changes after [`TurnStep::Wait`] read `wake`,
    /// or until `until_ns` (`CLOCK_MONOTONIC`), whichever is first.
    pub fn wait(&self, wake: u32, until_ns: u64) {
        let left = until_ns.saturating_sub(crate::bucket::monotonic_ns());
        if left == 0 {
            return;
        }
        let timeout = libc::timespec {
            tv_sec: (left / 1_000_000_000) as libc::time_t,
            tv_nsec: (left % 1_000_000_000) as libc::c_long,
        };
        // SAFETY: `wake` is an aligned 32-bit word of a shared mapping that
        // is never unmapped, and `timeout` outlives the call. FUTEX_WAIT
        // (not private: the waker is another process) only reads the word;
        // it returns at once when the word is no longer `wake`.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.wake.as_ptr(),
                libc::FUTEX_WAIT,
                wake,
                &raw const timeout,
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// Bumps [`Self::wake`] and wakes every process waiting on it.
    fn bump(&self) {
        self.wake.fetch_add(1, Ordering::AcqRel);
        // SAFETY: as in `wait`: an aligned word of a mapping never unmapped;
        // FUTEX_WAKE reads nothing else.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.wake.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                std::ptr::null::<libc::timespec>(),
                std::ptr::null::<u32>(),
                0u32,
            );
        }
    }

    /// The pod key of the holder (0: none) and the pods that want a turn, at
    /// `now_ns`: the hypervisor's view.
    pub fn view(&self, now_ns: u64) -> TurnView {
        let quantum_us = self.quantum_ns() / 1_000;
        let turn = Turn::decode(
            self.turn.load(Ordering::Acquire),
            now_ns / 1_000,
            quantum_us,
        );
        TurnView {
            quantum_us,
            holder: turn
                .holder
                .map_or(0, |slot| self.slots[slot].pod.load(Ordering::Relaxed)),
            wanting: (0..PODS_PER_DEVICE)
                .filter(|&slot| self.wanting(slot, now_ns, WANT_NS))
                .count(),
            handovers: self.handovers.load(Ordering::Relaxed),
        }
    }
}

/// A GPU's turns as the hypervisor reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TurnView {
    /// How long a turn lasts, µs (0: no turns).
    pub quantum_us: u64,
    /// Pod key of the holder; 0: none.
    pub holder: u64,
    /// Pods that want a turn.
    pub wanting: usize,
    /// Turns handed from one pod to another.
    pub handovers: u64,
}

#[cfg(test)]
mod tests;
