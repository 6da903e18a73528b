//! Which pods make room on a GPU: idle ones, those whose host copies are
//! ready first (their swap-out only copies, at the speed of the link, where
//! another's pins host memory first, seconds for tens of GiB, which the
//! request waiting for the room would wait for), then those whose copies
//! are being made (the swap-out waits for the rest), then those used least
//! often of late (LRU-2: by the end of their use before the last one, then
//! by their last call), latency-class pods last or never, the largest first
//! where the rest ties, and a pod just brought back only when nothing else
//! can go; never a pod that must stay (placed on a GPU that does not
//! overcommit); all within the node's host-memory cap.
//!
//! Ahead of need, where no call waits, ready copies put a pod first only
//! where it is not popular ([`RoomFor::Headroom`]): a pod brought back
//! keeps its copies, so without that rule a popular pod found swapped out
//! would go again after each of its requests, and come back for the next.
//!
//! A pod's last-call stamp is written by the pod itself: it is read only as
//! a hint of idleness. A stamp in the future is none the daemon can use and
//! reads as "never" ([`stamp_age`]): forging one only makes the pod look
//! idle, which lets it be swapped sooner, never later, and never makes it
//! look active. A pod can look used by calling CUDA, forged or not: its
//! uses ([`crate::uses`]) are the daemon's samples of that stamp.

use serde::Serialize;

/// A pod that could be swapped out to make room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// The pod's id.
    pub pod: String,
    /// Device memory it holds on the GPU, which swapping it frees.
    pub bytes: u64,
    /// `CLOCK_MONOTONIC` milliseconds of its last CUDA call (0: none yet),
    /// as its processes stamp it.
    pub last_call_ms: u64,
    /// The last call of its use before the one that ended at
    /// `last_call_ms` (0: none seen), as the daemon's samples saw it.
    pub previous_use_ms: u64,
    /// When the daemon last brought it back (0: not in this run).
    pub back_ms: u64,
    /// Whether it is of the latency class.
    pub latency: bool,
    /// Whether it must stay: it is also placed on a GPU that does not
    /// overcommit (under Kubernetes, a claim that asked for a device whose
    /// `overcommit` attribute is false), so it is never swapped for room.
    pub stays: bool,
    /// Whether its processes keep host copies of what it holds: its
    /// swap-out then only copies.
    pub ready: bool,
    /// Whether its processes are making those copies now: its swap-out
    /// waits for what is left of that, then only copies.
    pub preparing: bool,
}

/// Where latency-class pods come among those that make room.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum LatencyPods {
    /// After every other idle pod.
    Last,
    /// Never swapped to make room (an operator still may).
    Never,
}

impl LatencyPods {
    /// `last` or `never`, as the config file writes it.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "last" => Some(Self::Last),
            "never" => Some(Self::Never),
            _ => None,
        }
    }
}

/// How idle pods are ranked: by recency alone, or by recency and
/// frequency.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Ranking {
    /// Least recently used first: the oldest last call goes first.
    Lru,
    /// LRU-2: the oldest use before the last goes first (a pod used once
    /// goes before any used twice), then the oldest last call. A pod called
    /// once in a while does not push out one called often.
    Lru2,
}

impl Ranking {
    /// `lru` or `lru-2`, as the config file writes it.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "lru" => Some(Self::Lru),
            "lru-2" => Some(Self::Lru2),
            _ => None,
        }
    }

    /// As the config file writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Lru2 => "lru-2",
        }
    }
}

/// How room is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomPolicy {
    /// A pod is idle once its last call is this old.
    pub idle_after_ms: u64,
    /// Where latency pods come.
    pub latency: LatencyPods,
    /// How idle pods are ranked.
    pub ranking: Ranking,
    /// A pod brought back this recently goes only when no other can.
    pub min_resident_ms: u64,
}

/// How long before `now_ms` a pod's call stamped `stamp_ms` was, both
/// `CLOCK_MONOTONIC` milliseconds; a stamp in the future (the pod's
/// processes stamp from a clock behind the daemon's, never ahead) is
/// forged and reads as the oldest there is.
pub fn stamp_age(stamp_ms: u64, now_ms: u64) -> u64 {
    now_ms.checked_sub(stamp_ms).unwrap_or(u64::MAX)
}

/// What room is made for, which decides whether a pod's ready copies put
/// it first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomFor {
    /// A call that waits for it: the pod that goes fastest goes first.
    Call,
    /// A GPU's headroom, kept ahead of need, or copies prepared for the
    /// pods that go next: no call waits, so a popular pod keeping its
    /// copies does not go first ([`popular`]); a colder pod has its copies
    /// made, outside the swap lock, and goes instead.
    Headroom,
}

/// The idle pods that may make room, in the order they go (see the module
/// documentation): those brought back within `min_resident_ms` after all
/// others.
pub fn ranked(
    candidates: &[Candidate],
    now_ms: u64,
    policy: RoomPolicy,
    room_for: RoomFor,
) -> Vec<&Candidate> {
    let mut idle = idle(candidates, now_ms, policy);
    let popular = popular(&idle, now_ms, policy, room_for);
    idle.sort_by_key(|c| {
        let last = stamp_age(c.last_call_ms, now_ms);
        let first = match policy.ranking {
            Ranking::Lru => last,
            Ranking::Lru2 if c.previous_use_ms == 0 => u64::MAX,
            Ranking::Lru2 => stamp_age(c.previous_use_ms, now_ms),
        };
        // Copies ready first, then copies being made (the swap-out waits
        // for the rest of them), then none.
        let copies = match (c.ready, c.preparing) {
            _ if popular(c) => 2,
            (true, _) => 0,
            (false, true) => 1,
            (false, false) => 2,
        };
        (
            just_back(c, now_ms, policy),
            c.latency,
            copies,
            std::cmp::Reverse(first),
            std::cmp::Reverse(last),
            std::cmp::Reverse(c.bytes),
            c.pod.clone(),
        )
    });
    idle
}

/// Whether `candidate` may ever make room: it holds memory, and it is
/// neither a pod that must stay nor a latency pod the policy never swaps.
fn may_go(candidate: &Candidate, policy: RoomPolicy) -> bool {
    candidate.bytes > 0
        && !candidate.stays
        && !(candidate.latency && policy.latency == LatencyPods::Never)
}

/// The pods that may make room now: those that may ever ([`may_go`]),
/// idle.
fn idle(candidates: &[Candidate], now_ms: u64, policy: RoomPolicy) -> Vec<&Candidate> {
    candidates
        .iter()
        .filter(|c| may_go(c, policy))
        .filter(|c| stamp_age(c.last_call_ms, now_ms) >= policy.idle_after_ms)
        .collect()
}

/// Which pods are popular, for `room_for`: ahead of need
/// ([`RoomFor::Headroom`]) and under LRU-2, those used twice since the
/// last call of the least recently called idle pod that keeps no copies
/// (the end of their use before the last is newer): such a pod, gone,
/// would be asked for again before that one. None for a call that waits,
/// and none under LRU, which does not count uses.
fn popular(
    idle: &[&Candidate],
    now_ms: u64,
    policy: RoomPolicy,
    room_for: RoomFor,
) -> impl Fn(&Candidate) -> bool + use<> {
    let coldest = (room_for == RoomFor::Headroom && policy.ranking == Ranking::Lru2)
        .then(|| {
            idle.iter()
                .filter(|c| !(c.ready || c.preparing || just_back(c, now_ms, policy)))
                .map(|c| stamp_age(c.last_call_ms, now_ms))
                .max()
        })
        .flatten();
    move |c: &Candidate| {
        coldest.is_some_and(|coldest| {
            c.previous_use_ms != 0 && stamp_age(c.previous_use_ms, now_ms) < coldest
        })
    }
}

/// Whether `candidate` was brought back within `min_resident_ms`.
fn just_back(candidate: &Candidate, now_ms: u64, policy: RoomPolicy) -> bool {
    candidate.back_ms != 0 && stamp_age(candidate.back_ms, now_ms) < policy.min_resident_ms
}

/// The pods to swap out, in order, so that at least `need` bytes are freed
/// without putting more than `host_room` bytes in host memory; empty when
/// the idle pods cannot free `need` (swapping some would gain nothing).
pub fn victims(
    candidates: &[Candidate],
    need: u64,
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
) -> Vec<&Candidate> {
    let mut chosen = Vec::new();
    let (mut freed, mut on_host) = (0u64, 0u64);
    for candidate in ranked(candidates, now_ms, policy, RoomFor::Call) {
        if freed >= need {
            break;
        }
        if on_host.saturating_add(candidate.bytes) > host_room {
            continue;
        }
        freed = freed.saturating_add(candidate.bytes);
        on_host = on_host.saturating_add(candidate.bytes);
        chosen.push(candidate);
    }
    if freed >= need { chosen } else { Vec::new() }
}

/// Whether `need` bytes can be had now on a GPU with `free` bytes free:
/// they are free, or idle pods can free them ([`victims`]).
pub fn room_now(
    candidates: &[Candidate],
    need: u64,
    free: u64,
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
) -> bool {
    free >= need || !victims(candidates, need - free, host_room, now_ms, policy).is_empty()
}

/// Whether `need` bytes could ever be had on a GPU with `free` bytes free,
/// were every pod that may make room idle (busy or not now, within
/// `host_room`): false while the pods that never go (those that must stay,
/// and latency pods where the policy never swaps them) leave too little.
pub fn room_ever(
    candidates: &[Candidate],
    need: u64,
    free: u64,
    host_room: u64,
    policy: RoomPolicy,
) -> bool {
    let could_go = candidates
        .iter()
        .filter(|c| may_go(c, policy))
        .fold(0u64, |sum, c| sum.saturating_add(c.bytes));
    free.saturating_add(could_go.min(host_room)) >= need
}

/// The pod to swap out ahead of need (to keep a GPU's headroom free): the
/// first that [`ranked`] gives for [`RoomFor::Headroom`] and `host_room`
/// takes, never one brought back within `min_resident_ms` (no request
/// waits on it, so no pod is swapped back and forth for it).
pub fn ahead(
    candidates: &[Candidate],
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
) -> Option<&Candidate> {
    ranked(candidates, now_ms, policy, RoomFor::Headroom)
        .into_iter()
        .find(|c| !just_back(c, now_ms, policy) && c.bytes <= host_room)
}

/// The longest the daemon waits for a pod whose host copies are ready
/// (ahead of need, or making room) rather than have another pod pin its
/// copies, on a full host by giving the first one's back: about what
/// pinning a pod's copies of tens of GiB takes on an H200 host, which the
/// pod waited for would cost again at its own next swap-out.
pub const READY_SOON_MS: u64 = 2_000;

/// How long until a pod whose host copies are ready, and that frees
/// `need` bytes by itself, may go ([`ahead`], [`victims`]) where none may
/// now: one brought back within `min_resident_ms`, or not idle yet, that
/// becomes both within [`READY_SOON_MS`]; `None` where there is none. Its
/// swap-out only copies into the copies it keeps, where another pod's
/// would pin host memory first, and on a full host only once that very
/// pod gave its copies back: seconds of pinning, twice, instead of none.
/// Ahead of need ([`RoomFor::Headroom`]) a popular pod is not waited for:
/// it would not go first once it may.
pub fn ready_soon(
    candidates: &[Candidate],
    need: u64,
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
    room_for: RoomFor,
) -> Option<u64> {
    let popular = popular(&idle(candidates, now_ms, policy), now_ms, policy, room_for);
    candidates
        .iter()
        .filter(|c| c.ready && may_go(c, policy) && !popular(c))
        .filter(|c| c.bytes >= need && c.bytes <= host_room)
        .map(|c| {
            let back_in = match c.back_ms {
                0 => 0,
                back => policy
                    .min_resident_ms
                    .saturating_sub(stamp_age(back, now_ms)),
            };
            let idle_in = policy
                .idle_after_ms
                .saturating_sub(stamp_age(c.last_call_ms, now_ms));
            back_in.max(idle_in)
        })
        .filter(|&wait| wait > 0 && wait <= READY_SOON_MS)
        .min()
}

/// The next step of making room for `need` bytes ([`victims`]).
#[derive(Debug, PartialEq, Eq)]
pub enum RoomStep<'a> {
    /// This pod goes.
    Go(&'a Candidate),
    /// A pod whose copies are ready may go in this many milliseconds.
    Wait(u64),
}

/// The next step of making room for `need` bytes: the first of
/// [`victims`]; or, where that one's swap-out would pin host memory
/// first (its processes keep no copies, or are still making them) and
/// `may_wait`, waiting for a pod that keeps its copies and may go within
/// [`READY_SOON_MS`] ([`ready_soon`]). `None` where no pod can free it.
pub fn room_step(
    candidates: &[Candidate],
    need: u64,
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
    may_wait: bool,
) -> Option<RoomStep<'_>> {
    let first = *victims(candidates, need, host_room, now_ms, policy).first()?;
    if !first.ready
        && may_wait
        && let Some(ms) = ready_soon(candidates, need, host_room, now_ms, policy, RoomFor::Call)
    {
        return Some(RoomStep::Wait(ms));
    }
    Some(RoomStep::Go(first))
}

/// The pod whose host copies to prepare ahead of its swap-out (so that
/// its first fast swap-out only copies, instead of pinning fresh host
/// memory as it copies): the first that [`ranked`] gives that `unprepared`
/// says lacks copies, whose bytes `host_room` takes. The pods that go next
/// are prepared first; those brought back within `min_resident_ms` come
/// last, as they go last.
pub fn prepare_next(
    candidates: &[Candidate],
    unprepared: impl Fn(&Candidate) -> bool,
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
) -> Option<&Candidate> {
    ranked(candidates, now_ms, policy, RoomFor::Headroom)
        .into_iter()
        .find(|c| c.bytes <= host_room && unprepared(c))
}

/// The order in which resident pods give back the host copies they keep
/// when another pod's swap-out needs the room, given each one's last call:
/// the most recently called first, as the least likely to go next, so
/// that the copies prepared for the pods that go next are given back last.
pub fn give_back_order(kept: &mut [(String, u64)]) {
    kept.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
}

#[cfg(test)]
mod tests;
