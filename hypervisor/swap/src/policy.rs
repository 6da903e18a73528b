//! Which pods make room on a GPU: idle ones, least recently used first,
//! latency-class pods last or never, within the node's host-memory cap.
//!
//! A pod's last-call stamp is written by the pod itself: it is read only as
//! a hint of idleness. A stamp in the future is none the daemon can use and
//! reads as "never" ([`stamp_age`]): forging one only makes the pod look
//! idle, which lets it be swapped sooner, never later, and never makes it
//! look active.

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
    /// Whether it is of the latency class.
    pub latency: bool,
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

/// How room is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomPolicy {
    /// A pod is idle once its last call is this old.
    pub idle_after_ms: u64,
    /// Where latency pods come.
    pub latency: LatencyPods,
}

/// How long before `now_ms` a pod's call stamped `stamp_ms` was, both
/// `CLOCK_MONOTONIC` milliseconds; a stamp in the future (the pod's
/// processes stamp from a clock behind the daemon's, never ahead) is
/// forged and reads as the oldest there is.
pub fn stamp_age(stamp_ms: u64, now_ms: u64) -> u64 {
    now_ms.checked_sub(stamp_ms).unwrap_or(u64::MAX)
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
    let mut idle: Vec<&Candidate> = candidates
        .iter()
        .filter(|c| c.bytes > 0)
        .filter(|c| stamp_age(c.last_call_ms, now_ms) >= policy.idle_after_ms)
        .filter(|c| !(c.latency && policy.latency == LatencyPods::Never))
        .collect();
    idle.sort_by_key(|c| {
        (
            c.latency,
            std::cmp::Reverse(stamp_age(c.last_call_ms, now_ms)),
            c.pod.clone(),
        )
    });
    let mut chosen = Vec::new();
    let (mut freed, mut on_host) = (0u64, 0u64);
    for candidate in idle {
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

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const POLICY: RoomPolicy = RoomPolicy {
        idle_after_ms: 1_000,
        latency: LatencyPods::Last,
    };

    fn pod(name: &str, gib: u64, last_call_ms: u64, latency: bool) -> Candidate {
        Candidate {
            pod: name.into(),
            bytes: gib * GIB,
            last_call_ms,
            latency,
        }
    }

    fn names(chosen: &[&Candidate]) -> Vec<String> {
        chosen.iter().map(|c| c.pod.clone()).collect()
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
}
