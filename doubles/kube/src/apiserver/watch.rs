//! Watch streams, one JSON event a line, as the API server sends them:
//!
//! - no resourceVersion (or "0"): ADDED for each current object, then the
//!   changes after; with `sendInitialEvents=true`, then a BOOKMARK marked
//!   `k8s.io/initial-events-end`;
//! - resourceVersion N: the changes after N from history, then live ones;
//!   if history no longer reaches N, one ERROR event (410 Expired) and the
//!   end of the stream, as after a live watcher falls too far behind;
//! - with a selector, an object that stops matching is DELETED (its last
//!   matching state) and one that starts is ADDED;
//! - `allowWatchBookmarks=true`: a BOOKMARK (kind, apiVersion, the
//!   resourceVersion reached) every [`Options::bookmark_interval`](super::Options);
//! - the stream ends after `timeoutSeconds`.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use poem::http::StatusCode;
use poem::{Body, Response};
use serde_json::{Value, json};
use tokio::sync::broadcast;

use super::read::Filter;
use super::resources::Resource;
use super::status::{ApiError, Result};
use super::store::{Change, EventType};
use super::{Params, State, Target};

/// What one change is to one watcher, if anything.
fn translate(r: &Resource, filter: &Filter, change: &Change) -> Option<(EventType, Value)> {
    if change.key.0 != r.plural {
        return None;
    }
    let ns = &change.key.1;
    let now = change.kind != EventType::Deleted && filter.matches(ns, &change.object);
    let before = change
        .previous
        .as_ref()
        .is_some_and(|p| filter.matches(ns, p));
    match (change.kind, before, now) {
        (EventType::Deleted, true, _) => Some((EventType::Deleted, change.object.clone())),
        (_, false, true) => Some((EventType::Added, change.object.clone())),
        (_, true, true) => Some((EventType::Modified, change.object.clone())),
        (EventType::Modified, true, false) => {
            // Its last state that matched, at the change's resourceVersion.
            let mut last = change.previous.clone().unwrap_or_default();
            last["metadata"]["resourceVersion"] = json!(change.rv.to_string());
            Some((EventType::Deleted, last))
        }
        _ => None,
    }
}

fn line(kind: &str, object: &Value) -> Vec<u8> {
    let mut out = json!({"type": kind, "object": object})
        .to_string()
        .into_bytes();
    out.push(b'\n');
    out
}

fn bookmark(r: &Resource, rv: u64, initial_end: bool) -> Vec<u8> {
    let mut metadata = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        metadata["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    line(
        "BOOKMARK",
        &json!({"kind": r.kind, "apiVersion": r.api_version(), "metadata": metadata}),
    )
}

fn expired(message: String) -> Vec<u8> {
    line("ERROR", &ApiError::expired(message).status())
}

fn invalid_options(why: &str) -> ApiError {
    ApiError {
        details: Some(
            json!({"kind": "ListOptions", "group": "meta.k8s.io", "causes": [
                {"reason": "FieldValueForbidden", "message": format!("Forbidden: {why}"), "field": "sendInitialEvents"},
            ]}),
        ),
        ..ApiError::new(
            422,
            "Invalid",
            format!("ListOptions.meta.k8s.io \"\" is invalid: sendInitialEvents: Forbidden: {why}"),
        )
    }
}

struct Stream {
    r: &'static Resource,
    filter: Filter,
    /// Lines ready to send.
    ready: VecDeque<Vec<u8>>,
    live: broadcast::Receiver<Change>,
    /// The resources whose events are held back (see `hold_watch_events`).
    held: tokio::sync::watch::Receiver<BTreeSet<String>>,
    /// The highest resourceVersion looked at (sent or filtered out).
    seen: u64,
    bookmarks: Option<tokio::time::Interval>,
    deadline: tokio::time::Instant,
    /// Ends after `ready` is sent.
    ending: bool,
}

impl Stream {
    fn take(&mut self, change: &Change) {
        if change.rv <= self.seen {
            return;
        }
        self.seen = change.rv;
        if let Some((kind, object)) = translate(self.r, &self.filter, change) {
            self.ready.push_back(line(kind.as_str(), &object));
        }
    }

    async fn next(&mut self) -> Option<Vec<u8>> {
        loop {
            if self.held.borrow_and_update().contains(self.r.plural) {
                tokio::select! {
                    changed = self.held.changed() => if changed.is_err() { return None },
                    () = tokio::time::sleep_until(self.deadline) => return None,
                }
                continue;
            }
            if let Some(line) = self.ready.pop_front() {
                return Some(line);
            }
            if self.ending {
                return None;
            }
            let tick = async {
                match &mut self.bookmarks {
                    Some(interval) => {
                        interval.tick().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                received = self.live.recv() => match received {
                    Ok(change) => self.take(&change),
                    Err(broadcast::error::RecvError::Lagged(_)) => {
                        self.ready.push_back(expired(format!(
                            "too old resource version: {} (watcher fell behind)",
                            self.seen
                        )));
                        self.ending = true;
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                () = tick => {
                    if self.seen > 0 {
                        self.ready.push_back(bookmark(self.r, self.seen, false));
                    }
                }
                () = tokio::time::sleep_until(self.deadline) => return None,
            }
        }
    }
}

/// A watch of `target`.
pub(crate) fn serve(state: &Arc<State>, target: &Target, params: &Params) -> Result<Response> {
    let r = target.resource;
    let filter = Filter::new(target, params)?;
    let allow_bookmarks = params.flag("allowWatchBookmarks");
    let initial_events = match params.get("sendInitialEvents") {
        Some("true" | "1") => Some(true),
        Some("false" | "0") => Some(false),
        _ => None,
    };
    let rv =
        match params.get("resourceVersion").filter(|s| !s.is_empty()) {
            None => None,
            Some(text) => Some(text.parse::<u64>().map_err(|_| {
                ApiError::bad_request(format!("invalid resource version: {text:?}"))
            })?),
        };
    if initial_events.is_some() {
        if params.get("resourceVersionMatch") != Some("NotOlderThan") {
            return Err(invalid_options(
                "sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        if initial_events == Some(true) && !allow_bookmarks {
            return Err(invalid_options(
                "sendInitialEvents requires setting allowWatchBookmarks to true",
            ));
        }
    }
    let timeout = params
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map_or(Duration::from_secs(1800), Duration::from_secs);
    let store = state.store();
    // Subscribed under the store's lock: writes publish under it too.
    let live = state.changes.subscribe();
    let mut stream = Stream {
        r,
        filter,
        ready: VecDeque::new(),
        live,
        held: state.held.subscribe(),
        seen: 0,
        bookmarks: None,
        deadline: tokio::time::Instant::now() + timeout,
        ending: false,
    };
    let from_state = initial_events.unwrap_or(matches!(rv, None | Some(0)));
    if from_state {
        for ((_, ns, _), object) in store.of(r.plural) {
            if stream.filter.matches(ns, object) {
                stream.ready.push_back(line("ADDED", object));
            }
        }
        stream.seen = store.rv;
        if initial_events == Some(true) {
            stream.ready.push_back(bookmark(r, store.rv, true));
        }
    } else {
        let since = rv.unwrap_or_default();
        match store.since(since) {
            Some(changes) => {
                stream.seen = since;
                for change in &changes {
                    stream.take(change);
                }
                stream.seen = stream.seen.max(since);
            }
            None => {
                stream.ready.push_back(expired(format!(
                    "too old resource version: {since} ({})",
                    store.compacted
                )));
                stream.ending = true;
            }
        }
    }
    drop(store);
    if allow_bookmarks {
        let period = state.options.bookmark_interval;
        let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        stream.bookmarks = Some(interval);
    }
    let body = futures::stream::unfold(stream, |mut s| async move {
        let line = s.next().await?;
        Some((Ok::<_, std::io::Error>(line), s))
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .content_type("application/json")
        .body(Body::from_bytes_stream(body)))
}
