//! Watch streams of the fake API server: the changes after the asked
//! `resourceVersion` from the log, then live ones, one JSON event a line,
//! until `timeoutSeconds`.

use std::collections::VecDeque;
use std::sync::Arc;

use poem::http::StatusCode;
use poem::{Body, Response};
use serde_json::json;
use tokio::sync::broadcast;

use super::apiserver::{Change, Query, State, selected};

pub(crate) fn watch(
    state: &Arc<State>,
    resource: String,
    namespace: Option<String>,
    q: Query,
) -> Response {
    // Subscribed before reading the log: nothing falls between the two.
    let live = state.changes.subscribe();
    let since = q.resource_version.unwrap_or(0);
    let backlog: VecDeque<Change> = state
        .store()
        .log
        .iter()
        .filter(|c| c.rv > since)
        .cloned()
        .collect();
    let last_sent = since;
    let deadline =
        tokio::time::Instant::now() + q.timeout.unwrap_or(std::time::Duration::from_secs(300));
    let wanted = move |c: &Change| {
        c.resource == resource && selected(&q, namespace.as_deref(), &c.namespace, &c.object)
    };
    struct S<F> {
        backlog: VecDeque<Change>,
        live: broadcast::Receiver<Change>,
        last_sent: u64,
        wanted: F,
        deadline: tokio::time::Instant,
    }
    let stream = futures::stream::unfold(
        S {
            backlog,
            live,
            last_sent,
            wanted,
            deadline,
        },
        |mut s| async move {
            loop {
                let change = match s.backlog.pop_front() {
                    Some(change) => change,
                    None => match tokio::time::timeout_at(s.deadline, s.live.recv()).await {
                        Ok(Ok(change)) => change,
                        Ok(Err(broadcast::error::RecvError::Lagged(_))) => {
                            let line = json!({"type": "ERROR", "object": {
                                "kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "Expired", "code": 410, "message": "too old resource version"}});
                            return Some((
                                Ok::<_, std::io::Error>(format!("{line}\n").into_bytes()),
                                s,
                            ));
                        }
                        Ok(Err(broadcast::error::RecvError::Closed)) | Err(_) => return None,
                    },
                };
                if change.rv <= s.last_sent || !(s.wanted)(&change) {
                    continue;
                }
                s.last_sent = change.rv;
                let line = json!({"type": change.kind, "object": change.object});
                return Some((Ok(format!("{line}\n").into_bytes()), s));
            }
        },
    );
    Response::builder()
        .status(StatusCode::OK)
        .content_type("application/json")
        .body(Body::from_bytes_stream(stream))
}
