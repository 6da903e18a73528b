//! Swapped pods asking to come back, in the order they first asked. The
//! daemon serves asks one at a time, in the order they arrive; one that is
//! refused for want of room asks again, and would lose its place to any ask
//! that arrives meanwhile. So a pod keeps its first place here while it
//! waits for room, and a later ask for a GPU it waits on waits behind it.
//! A pod that stops asking (its processes exited, or gave up) loses its
//! place after [`STALE`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// A pod that has not asked for this long, and has no ask under way, is no
/// longer waiting.
pub const STALE: Duration = Duration::from_secs(2);

#[derive(Debug)]
struct Ask {
    /// Its place: lower asked first.
    place: u64,
    /// When it first asked.
    first: Instant,
    /// Its asks under way.
    in_flight: u32,
    /// When its last ask ended.
    seen: Instant,
    /// Whether its last ask was refused for want of room.
    for_room: bool,
}

#[derive(Debug, Default)]
struct Inner {
    pods: BTreeMap<String, Ask>,
    next: u64,
}

/// The pods asking to come back.
#[derive(Debug, Default, Clone)]
pub struct Asks {
    inner: Arc<Mutex<Inner>>,
}

/// One ask under way; its end is recorded when it is dropped.
#[derive(Debug)]
pub struct Asking {
    asks: Asks,
    pod: String,
}

impl Drop for Asking {
    fn drop(&mut self) {
        if let Some(ask) = self.asks.lock().pods.get_mut(&self.pod) {
            ask.in_flight = ask.in_flight.saturating_sub(1);
            ask.seen = Instant::now();
        }
    }
}

impl Asks {
    /// `pod` asks to come back: it takes the last place unless it has one.
    pub fn ask(&self, pod: &str) -> Asking {
        let mut inner = self.lock();
        let now = Instant::now();
        inner.pods.retain(|_, ask| live(ask, now));
        if !inner.pods.contains_key(pod) {
            let place = inner.next;
            inner.next += 1;
            inner.pods.insert(
                pod.to_owned(),
                Ask {
                    place,
                    first: now,
                    in_flight: 0,
                    seen: now,
                    for_room: false,
                },
            );
        }
        if let Some(ask) = inner.pods.get_mut(pod) {
            ask.in_flight += 1;
        }
        Asking {
            asks: self.clone(),
            pod: pod.to_owned(),
        }
    }

    /// `pod`'s ask was refused for want of room: it keeps its place.
    pub fn refused_for_room(&self, pod: &str) {
        if let Some(ask) = self.lock().pods.get_mut(pod) {
            ask.for_room = true;
        }
    }

    /// `pod` is back (or needs nothing): it leaves the queue. Returns how
    /// long it waited since it first asked, where it was refused for want
    /// of room on the way.
    pub fn served(&self, pod: &str) -> Option<Duration> {
        let ask = self.lock().pods.remove(pod)?;
        ask.for_room.then(|| ask.first.elapsed())
    }

    /// The pods that asked before `pod` and still wait for room, first
    /// first, each with how long ago it first asked.
    pub fn ahead_of(&self, pod: &str) -> Vec<(String, Duration)> {
        let inner = self.lock();
        let Some(place) = inner.pods.get(pod).map(|ask| ask.place) else {
            return Vec::new();
        };
        waiting(&inner, |ask| ask.place < place)
    }

    /// Every pod waiting for room, first first.
    pub fn waiting(&self) -> Vec<String> {
        let all = waiting(&self.lock(), |_| true);
        all.into_iter().map(|(pod, _)| pod).collect()
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // Every update is one step: a panic elsewhere leaves it usable.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

fn live(ask: &Ask, now: Instant) -> bool {
    ask.in_flight > 0 || now.duration_since(ask.seen) < STALE
}

fn waiting(inner: &Inner, also: impl Fn(&Ask) -> bool) -> Vec<(String, Duration)> {
    let now = Instant::now();
    let mut found: Vec<(u64, &String, Duration)> = inner
        .pods
        .iter()
        .filter(|(_, ask)| ask.for_room && live(ask, now) && also(ask))
        .map(|(pod, ask)| (ask.place, pod, now.duration_since(ask.first)))
        .collect();
    found.sort();
    found
        .into_iter()
        .map(|(_, pod, waited)| (pod.clone(), waited))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pod_refused_for_room_keeps_its_place_over_later_asks() {
        let asks = Asks::default();
        drop(asks.ask("first"));
        asks.refused_for_room("first");
        drop(asks.ask("second"));
        asks.refused_for_room("second");
        let _third = asks.ask("third");
        // The first asks again: its place stays the first.
        let _again = asks.ask("first");
        assert_eq!(asks.waiting(), ["first", "second"]);
        assert_eq!(names(asks.ahead_of("third")), ["first", "second"]);
        assert_eq!(names(asks.ahead_of("second")), ["first"]);
        assert!(asks.ahead_of("first").is_empty());
        assert!(asks.served("first").is_some(), "it waited for room");
        assert_eq!(names(asks.ahead_of("third")), ["second"]);
        assert_eq!(asks.served("third"), None, "it never waited for room");
    }

    fn names(ahead: Vec<(String, Duration)>) -> Vec<String> {
        ahead.into_iter().map(|(pod, _)| pod).collect()
    }

    #[test]
    fn only_pods_refused_for_room_are_waited_behind() {
        let asks = Asks::default();
        drop(asks.ask("failing"));
        let _later = asks.ask("later");
        assert!(asks.ahead_of("later").is_empty());
        assert!(asks.waiting().is_empty());
    }

    #[test]
    fn a_pod_that_stops_asking_loses_its_place() {
        let asks = Asks::default();
        drop(asks.ask("gone"));
        asks.refused_for_room("gone");
        if let Some(ask) = asks.lock().pods.get_mut("gone") {
            ask.seen = Instant::now() - STALE;
        }
        let _later = asks.ask("later");
        assert!(asks.ahead_of("later").is_empty());
        assert!(asks.waiting().is_empty());
    }

    #[test]
    fn a_pod_with_an_ask_under_way_keeps_its_place_however_long() {
        let asks = Asks::default();
        let asking = asks.ask("slow");
        asks.refused_for_room("slow");
        if let Some(ask) = asks.lock().pods.get_mut("slow") {
            ask.seen = Instant::now() - STALE * 2;
        }
        let _later = asks.ask("later");
        assert_eq!(names(asks.ahead_of("later")), ["slow"]);
        drop(asking);
        assert_eq!(asks.waiting(), ["slow"], "its ask just ended");
    }
}
