//! Which pods make room on a GPU: idle ones, those whose host copies are
//! ready first (their swap-out only copies, at the speed of the link, where
//! another's pins host memory first, seconds for tens of GiB, which the
//! request waiting for the room would wait for), then those used least
//! often of late (LRU-2: by the end of their use before the last one, then
//! by their last call), latency-class pods last or never, the largest first
//! where the rest ties, and a pod just brought back only when nothing else
//! can go; never a pod that must stay (placed on a GPU that does not
//! overcommit); all within the node's host-memory cap.
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

/// The idle pods that may make room, in the order they go (see the module
/// documentation): those brought back within `min_resident_ms` after all
/// others.
pub fn ranked(candidates: &[Candidate], now_ms: u64, policy: RoomPolicy) -> Vec<&Candidate> {
    let mut idle: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.bytes > 0 && !c.stays)
        .filter(|c| stamp_age(c.last_call_ms, now_ms) >= policy.idle_after_ms)
        .filter(|c| !(c.latency && policy.latency == LatencyPods::Never))
        .collect();
    idle.sort_by_key(|c| {
        let last = stamp_age(c.last_call_ms, now_ms);
        let first = match policy.ranking {
            Ranking::Lru => last,
            Ranking::Lru2 if c.previous_use_ms == 0 => u64::MAX,
            Ranking::Lru2 => stamp_age(c.previous_use_ms, now_ms),
        };
        (
            just_back(c, now_ms, policy),
            c.latency,
            !(c.ready || c.preparing),
            std::cmp::Reverse(first),
            std::cmp::Reverse(last),
            std::cmp::Reverse(c.bytes),
            c.pod.clone(),
        )
    });
    idle
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
    for candidate in ranked(candidates, now_ms, policy) {
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
    let may_go = candidates
        .iter()
        .filter(|c| !(c.stays || (c.latency && policy.latency == LatencyPods::Never)))
        .fold(0u64, |sum, c| sum.saturating_add(c.bytes));
    free.saturating_add(may_go.min(host_room)) >= need
}

/// The pod to swap out ahead of need (to keep a GPU's headroom free): the
/// first that [`ranked`] gives and `host_room` takes, never one brought
/// back within `min_resident_ms` (no request waits on it, so no pod is
/// swapped back and forth for it).
pub fn ahead(
    candidates: &[Candidate],
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
) -> Option<&Candidate> {
    ranked(candidates, now_ms, policy)
        .into_iter()
        .find(|c| !just_back(c, now_ms, policy) && c.bytes <= host_room)
}

/// The longest a background pass waits for a pod whose host copies are
/// ready rather than have another pod's copies made by giving them back:
/// about what pinning a pod's copies of tens of GiB takes on an H200 host,
/// which the pod waited for would cost again at its own next swap-out.
pub const READY_SOON_MS: u64 = 2_000;

/// How long until a pod whose host copies are ready, and that frees
/// `need` bytes by itself, may go ([`ahead`], [`victims`]) where none may
/// now: one brought back within `min_resident_ms`, or not idle yet, that
/// becomes both within [`READY_SOON_MS`]; `None` where there is none. Its
/// swap-out only copies into the copies it keeps, where another pod's
/// would pin host memory first, and on a full host only once that very
/// pod gave its copies back: seconds of pinning, twice, instead of none.
pub fn ready_soon(
    candidates: &[Candidate],
    need: u64,
    host_room: u64,
    now_ms: u64,
    policy: RoomPolicy,
) -> Option<u64> {
    candidates
        .iter()
        .filter(|c| c.ready && c.bytes > 0 && c.bytes >= need && c.bytes <= host_room)
        .filter(|c| !c.stays)
        .filter(|c| !(c.latency && policy.latency == LatencyPods::Never))
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
        && let Some(ms) = ready_soon(candidates, need, host_room, now_ms, policy)
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
    ranked(candidates, now_ms, policy)
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
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const POLICY: RoomPolicy = RoomPolicy {
        idle_after_ms: 1_000,
        latency: LatencyPods::Last,
        ranking: Ranking::Lru,
        min_resident_ms: 0,
    };
    const LRU2: RoomPolicy = RoomPolicy {
        ranking: Ranking::Lru2,
        min_resident_ms: 3_000,
        ..POLICY
    };

    fn pod(name: &str, gib: u64, last_call_ms: u64, latency: bool) -> Candidate {
        Candidate {
            pod: name.into(),
            bytes: gib * GIB,
            last_call_ms,
            previous_use_ms: 0,
            back_ms: 0,
            latency,
            stays: false,
            ready: false,
            preparing: false,
        }
    }

    /// A batch pod of `gib` whose last two uses ended at `previous` and
    /// `last`.
    fn used(name: &str, gib: u64, previous: u64, last: u64) -> Candidate {
        Candidate {
            previous_use_ms: previous,
            ..pod(name, gib, last, false)
        }
    }

    fn names(chosen: &[&Candidate]) -> Vec<String> {
        chosen.iter().map(|c| c.pod.clone()).collect()
    }

    #[test]
    fn host_copies_are_prepared_for_the_idle_pod_that_goes_next_within_host_room() {
        let pods = [
            pod("recent", 8, 8_000, false),
            pod("oldest", 8, 1_000, false),
            pod("big", 30, 2_000, false),
            pod("busy", 8, 9_900, false),
        ];
        let all = |_: &Candidate| true;
        let prepare = |room, unprepared: &dyn Fn(&Candidate) -> bool| {
            prepare_next(&pods, unprepared, room, 10_000, POLICY).map(|c| c.pod.clone())
        };
        assert_eq!(prepare(u64::MAX, &all).as_deref(), Some("oldest"));
        // The next one once it keeps its copies; past what host room takes.
        let not_oldest = |c: &Candidate| c.pod != "oldest";
        assert_eq!(prepare(u64::MAX, &not_oldest).as_deref(), Some("big"));
        assert_eq!(prepare(8 * GIB, &not_oldest).as_deref(), Some("recent"));
        assert_eq!(prepare(4 * GIB, &all), None);
        // A busy pod is never prepared: it is not about to go.
        let only_busy = |c: &Candidate| c.pod == "busy";
        assert_eq!(prepare(u64::MAX, &only_busy), None);
    }

    #[test]
    fn kept_copies_are_given_back_by_the_most_recently_called_first() {
        let mut kept = vec![
            ("next".to_owned(), 1_000),
            ("busy".to_owned(), 9_000),
            ("later".to_owned(), 5_000),
        ];
        give_back_order(&mut kept);
        let order: Vec<&str> = kept.iter().map(|(pod, _)| pod.as_str()).collect();
        assert_eq!(order, ["busy", "later", "next"]);
    }

    #[test]
    fn the_least_recently_used_idle_pods_go_first_and_no_more_than_needed() {
        let pods = [
            pod("recent", 8, 8_000, false),
            pod("oldest", 8, 1_000, false),
            pod("older", 8, 2_000, false),
            pod("busy", 30, 9_900, false),
        ];
        assert_eq!(
            names(&victims(&pods, 4 * GIB, u64::MAX, 10_000, POLICY)),
            ["oldest"]
        );
        assert_eq!(
            names(&victims(&pods, 12 * GIB, u64::MAX, 10_000, POLICY)),
            ["oldest", "older"]
        );
        // The busy pod is not idle: 24 GiB of idle pods cannot free 30.
        assert!(victims(&pods, 30 * GIB, u64::MAX, 10_000, POLICY).is_empty());
    }

    #[test]
    fn room_is_had_now_from_idle_pods_and_ever_from_every_pod_that_may_go() {
        let staying = Candidate {
            stays: true,
            ..pod("stays", 40, 1_000, false)
        };
        let pods = [
            pod("idle", 8, 1_000, false),
            pod("busy", 8, 9_900, false),
            pod("latency", 8, 1_000, true),
            staying,
        ];
        let never = RoomPolicy {
            latency: LatencyPods::Never,
            ..POLICY
        };
        // Free already, or freed by the idle pods (the latency pod last).
        assert!(room_now(&pods, 4 * GIB, 4 * GIB, 0, 10_000, POLICY));
        assert!(room_now(&pods, 12 * GIB, 4 * GIB, u64::MAX, 10_000, POLICY));
        assert!(room_now(&pods, 20 * GIB, 4 * GIB, u64::MAX, 10_000, POLICY));
        assert!(!room_now(&pods, 20 * GIB, 4 * GIB, u64::MAX, 10_000, never));
        // The busy pod is not idle now, but may go once it is.
        assert!(!room_now(
            &pods,
            21 * GIB,
            4 * GIB,
            u64::MAX,
            10_000,
            POLICY
        ));
        assert!(room_ever(&pods, 28 * GIB, 4 * GIB, u64::MAX, POLICY));
        // Never past what every pod that may go frees, nor host memory.
        assert!(!room_ever(&pods, 29 * GIB, 4 * GIB, u64::MAX, POLICY));
        assert!(!room_ever(&pods, 21 * GIB, 4 * GIB, u64::MAX, never));
        assert!(!room_ever(&pods, 21 * GIB, 4 * GIB, 16 * GIB, POLICY));
    }

    #[test]
    fn latency_pods_come_last_or_never() {
        let pods = [
            pod("latency", 8, 1_000, true),
            pod("batch", 8, 5_000, false),
        ];
        assert_eq!(
            names(&victims(&pods, GIB, u64::MAX, 10_000, POLICY)),
            ["batch"]
        );
        assert_eq!(
            names(&victims(&pods, 16 * GIB, u64::MAX, 10_000, POLICY)),
            ["batch", "latency"]
        );
        let never = RoomPolicy {
            latency: LatencyPods::Never,
            ..POLICY
        };
        assert!(victims(&pods, 16 * GIB, u64::MAX, 10_000, never).is_empty());
    }

    #[test]
    fn a_stamp_in_the_future_reads_as_the_oldest_and_idle() {
        let pods = [pod("old", 8, 1_000, false), pod("forged", 8, 99_000, false)];
        assert_eq!(
            names(&victims(&pods, GIB, u64::MAX, 10_000, POLICY)),
            ["forged"]
        );
        assert_eq!(stamp_age(99_000, 10_000), u64::MAX);
        assert_eq!(stamp_age(9_000, 10_000), 1_000);
    }

    #[test]
    fn the_host_cap_skips_pods_that_would_not_fit_there() {
        let pods = [pod("big", 40, 1_000, false), pod("small", 4, 2_000, false)];
        assert_eq!(
            names(&victims(&pods, 2 * GIB, 8 * GIB, 10_000, POLICY)),
            ["small"]
        );
        assert!(victims(&pods, 10 * GIB, 8 * GIB, 10_000, POLICY).is_empty());
    }

    #[test]
    fn lru_2_keeps_a_pod_used_often_over_one_used_once_more_recently() {
        let pods = [
            used("popular", 8, 4_000, 6_000),
            used("once", 8, 0, 7_000),
            used("twice-long-ago", 8, 1_000, 8_000),
        ];
        assert_eq!(
            names(&ranked(&pods, 10_000, LRU2)),
            ["once", "twice-long-ago", "popular"]
        );
        // By recency alone the popular pod, last called first, goes first.
        assert_eq!(
            names(&ranked(&pods, 10_000, POLICY)),
            ["popular", "once", "twice-long-ago"]
        );
    }

    #[test]
    fn where_the_uses_tie_the_larger_pod_goes_first() {
        let pods = [used("small", 4, 0, 5_000), used("large", 12, 0, 5_000)];
        assert_eq!(names(&ranked(&pods, 10_000, LRU2)), ["large", "small"]);
        assert_eq!(
            names(&victims(&pods, GIB, u64::MAX, 10_000, LRU2)),
            ["large"]
        );
    }

    #[test]
    fn a_pod_whose_host_copies_are_ready_goes_before_one_that_would_pin_first() {
        let ready = |c: Candidate| Candidate { ready: true, ..c };
        let pods = [
            used("oldest", 8, 1_000, 2_000),
            ready(used("copied", 8, 5_000, 6_000)),
            used("older", 8, 3_000, 4_000),
        ];
        assert_eq!(
            names(&ranked(&pods, 10_000, LRU2)),
            ["copied", "oldest", "older"]
        );
        assert_eq!(
            names(&victims(&pods, GIB, u64::MAX, 10_000, LRU2)),
            ["copied"]
        );
        // Still after every pod not just brought back, and latency pods last.
        let back = ready(Candidate {
            back_ms: 9_000,
            ..used("back", 8, 0, 9_000)
        });
        let latency = ready(pod("latency", 8, 1_000, true));
        let pods = [back, latency, used("cold", 8, 0, 3_000)];
        assert_eq!(
            names(&ranked(&pods, 10_000, LRU2)),
            ["cold", "latency", "back"]
        );
    }

    #[test]
    fn a_ready_pod_about_to_be_allowed_to_go_is_worth_waiting_for() {
        let policy = RoomPolicy {
            idle_after_ms: 200,
            min_resident_ms: 250,
            ..LRU2
        };
        let ready = |c: Candidate| Candidate { ready: true, ..c };
        // Brought back 100 ms ago, its last call 50 ms ago: it may go in
        // 150 ms (idle then, and past its 250 ms).
        let back = ready(Candidate {
            back_ms: 9_900,
            ..used("back", 8, 0, 9_950)
        });
        let cold = used("cold", 8, 1_000, 2_000);
        let pods = [back.clone(), cold.clone()];
        let first = ahead(&pods, u64::MAX, 10_000, policy).map(|c| c.pod.as_str());
        assert_eq!(first, Some("cold"));
        assert_eq!(
            ready_soon(&[back.clone(), cold.clone()], GIB, u64::MAX, 10_000, policy),
            Some(150)
        );
        // Once it may go, it goes first and no wait is needed.
        let pods = [back.clone(), cold.clone()];
        let first = ahead(&pods, u64::MAX, 10_150, policy).map(|c| c.pod.as_str());
        assert_eq!(first, Some("back"));
        assert_eq!(
            ready_soon(&[back.clone(), cold.clone()], GIB, u64::MAX, 10_150, policy),
            None
        );
        // Not worth it: no copies, copies the host could not take, a pod
        // that stays, one busy far longer than the wait is worth.
        let no_copies = Candidate {
            ready: false,
            ..back.clone()
        };
        assert_eq!(
            ready_soon(&[no_copies, cold.clone()], GIB, u64::MAX, 10_000, policy),
            None
        );
        assert_eq!(
            ready_soon(std::slice::from_ref(&back), GIB, 4 * GIB, 10_000, policy),
            None
        );
        // Nor a pod that frees less than is needed.
        assert_eq!(
            ready_soon(
                std::slice::from_ref(&back),
                9 * GIB,
                u64::MAX,
                10_000,
                policy
            ),
            None
        );
        let stays = Candidate {
            stays: true,
            ..back.clone()
        };
        assert_eq!(ready_soon(&[stays], GIB, u64::MAX, 10_000, policy), None);
        let long = RoomPolicy {
            min_resident_ms: 5_000,
            ..policy
        };
        assert_eq!(
            ready_soon(std::slice::from_ref(&back), GIB, u64::MAX, 10_000, long),
            None
        );
        // The soonest of several.
        let sooner = ready(Candidate {
            back_ms: 9_800,
            ..used("sooner", 8, 0, 9_850)
        });
        assert_eq!(
            ready_soon(&[back, sooner, cold], GIB, u64::MAX, 10_000, policy),
            Some(50)
        );
    }

    #[test]
    fn room_waits_a_moment_for_a_ready_pod_rather_than_pin_or_wait_for_a_preparation() {
        let policy = RoomPolicy {
            idle_after_ms: 200,
            min_resident_ms: 250,
            ..LRU2
        };
        let back = Candidate {
            back_ms: 9_900,
            ready: true,
            ..used("back", 8, 0, 9_950)
        };
        let cold = used("cold", 8, 1_000, 2_000);
        let pods = [back.clone(), cold.clone()];
        let step = |pods, may_wait| room_step(pods, GIB, u64::MAX, 10_000, policy, may_wait);
        // The cold pod would pin: the pod just back may go in 150 ms.
        assert_eq!(step(&pods, true), Some(RoomStep::Wait(150)));
        assert_eq!(step(&pods, false), Some(RoomStep::Go(&pods[1])));
        // A cold pod whose copies are being made goes first, but its
        // swap-out would wait for the rest of that: the ready pod is
        // waited for too.
        let preparing = [
            back.clone(),
            Candidate {
                preparing: true,
                ..cold.clone()
            },
        ];
        assert_eq!(step(&preparing, true), Some(RoomStep::Wait(150)));
        // A cold pod that keeps its copies goes at once.
        let kept = [
            back,
            Candidate {
                ready: true,
                ..cold
            },
        ];
        assert_eq!(step(&kept, true), Some(RoomStep::Go(&kept[1])));
        assert_eq!(step(&[], true), None);
    }

    #[test]
    fn a_pod_just_brought_back_goes_only_when_nothing_else_can() {
        let back = Candidate {
            back_ms: 8_000,
            ..used("back", 8, 0, 8_500)
        };
        let pods = [back, used("other", 8, 7_000, 9_000)];
        assert_eq!(
            names(&victims(&pods, GIB, u64::MAX, 10_000, LRU2)),
            ["other"]
        );
        // Nothing else can free 16 GiB: the pod just back goes too.
        assert_eq!(
            names(&victims(&pods, 16 * GIB, u64::MAX, 10_000, LRU2)),
            ["other", "back"]
        );
        // Ahead of need it never goes while it is that recent.
        assert_eq!(
            ahead(&pods[..1], u64::MAX, 10_000, LRU2).map(|c| c.pod.as_str()),
            None
        );
        assert_eq!(
            ahead(&pods[..1], u64::MAX, 11_001, LRU2).map(|c| c.pod.as_str()),
            Some("back")
        );
    }

    #[test]
    fn a_pod_that_must_stay_is_never_chosen() {
        let stays = Candidate {
            stays: true,
            ..used("stays", 8, 0, 1_000)
        };
        let pods = [stays, used("other", 4, 0, 2_000)];
        assert_eq!(names(&ranked(&pods, 10_000, LRU2)), ["other"]);
        assert!(victims(&pods, 8 * GIB, u64::MAX, 10_000, LRU2).is_empty());
        assert_eq!(
            ahead(&pods[..1], u64::MAX, 10_000, LRU2).map(|c| c.pod.as_str()),
            None
        );
    }

    #[test]
    fn ahead_of_need_takes_the_first_pod_host_memory_can_take() {
        let pods = [used("big", 40, 0, 1_000), used("small", 4, 0, 2_000)];
        assert_eq!(
            ahead(&pods, 8 * GIB, 10_000, LRU2).map(|c| c.pod.as_str()),
            Some("small")
        );
        assert_eq!(
            ahead(&pods, u64::MAX, 10_000, LRU2).map(|c| c.pod.as_str()),
            Some("big")
        );
        assert!(ahead(&pods, GIB, 10_000, LRU2).is_none());
    }

    #[test]
    fn rankings_parse_as_the_config_writes_them() {
        for ranking in [Ranking::Lru, Ranking::Lru2] {
            assert_eq!(Ranking::parse(ranking.as_str()), Some(ranking));
        }
        assert_eq!(Ranking::parse("lfu"), None);
    }
}
