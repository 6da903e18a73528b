//! Server side: a [`Hub`] of per-client task queues and the Poem routes that
//! serve it.
//!
//! Delivery is at-most-once by default: a task handed out by a long-poll leaves
//! the queue at once, so a response lost in transit loses the task (the ids of
//! delivered-but-unanswered tasks are still reported when the client expires).
//! With [`HubConfig::redeliver_after`] set, a delivered task that has no result
//! after that long is queued again: at-least-once, so handlers must then be
//! idempotent. Either way the first result for a task id wins; a later one is
//! answered 404.
//!
//! Hazard: hyper does not cancel a request whose client has gone away while the
//! request waits, so a long-poll parked by a client that then died (or stopped
//! its loop) stays parked until its wait ends. Until then the client counts as
//! polling (it cannot expire), and a task submitted in that window is handed to
//! the dead connection: it is then delivered-but-unanswered, which the expiry
//! event reports (and which `redeliver_after` queues again). A shorter
//! [`HubConfig::max_wait`] narrows the window.
//!
//! [`hub`] holds the queues, [`routes`] serves them over HTTP, [`sweeper`]
//! expires silent clients and queues unanswered tasks again; [`conn`]
//! bounds the connections of whatever a server serves.

pub mod conn;
mod hub;
mod routes;
mod sweeper;

use std::fmt;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::Value;
use tokio::sync::mpsc;

use crate::wire::{ClientId, TaskId};

pub use hub::Hub;
use hub::*;
pub use routes::{
    MAX_ERROR_CHARS, Refusal, bearer, json_error, json_response, malformed, read_body,
};

/// Authentication hook: given the client id from the path and the bearer token
/// from `Authorization: Bearer ...` (if any), says whether to serve the request.
/// A hook that panics counts as a refusal.
pub type AuthHook = Arc<dyn Fn(&ClientId, Option<&str>) -> bool + Send + Sync>;

/// Receiving end of a hub's events.
pub type HubEvents<R> = mpsc::UnboundedReceiver<HubEvent<R>>;

/// Tuning of a [`Hub`]. `HubConfig::default()` suits a node-local hypervisor.
#[derive(Clone)]
pub struct HubConfig {
    /// A client with no request in progress and none made for this long is
    /// removed, and [`HubEvent::Expired`] is emitted. Checked every quarter of
    /// the TTL (at most every second), so removal happens within 1.25 × TTL.
    pub client_ttl: Duration,
    /// Cap on a long-poll's `wait_ms`.
    pub max_wait: Duration,
    /// Largest accepted request body; larger ones are answered 413.
    pub max_body_bytes: usize,
    /// Most tasks handed out by one long-poll answer.
    pub max_batch: usize,
    /// Most clients held at once; a new client beyond this is answered 429.
    pub max_clients: usize,
    /// Most delivered-but-unanswered task ids remembered per client; past it
    /// the oldest is forgotten (its result will be answered 404).
    pub max_unanswered: usize,
    /// Re-queue a delivered task that has had no result for this long
    /// (at-least-once delivery). `None`: at-most-once.
    pub redeliver_after: Option<Duration>,
    /// Optional authentication check; a refusal is answered 401.
    pub auth: Option<AuthHook>,
}

impl Default for HubConfig {
    fn default() -> Self {
        Self {
            client_ttl: Duration::from_secs(30),
            max_wait: Duration::from_secs(30),
            max_body_bytes: 64 * 1024,
            max_batch: 256,
            max_clients: 10_000,
            max_unanswered: 4096,
            redeliver_after: None,
            auth: None,
        }
    }
}

impl HubConfig {
    /// Sets the authentication hook.
    pub fn with_auth(
        mut self,
        auth: impl Fn(&ClientId, Option<&str>) -> bool + Send + Sync + 'static,
    ) -> Self {
        self.auth = Some(Arc::new(auth));
        self
    }
}

impl fmt::Debug for HubConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HubConfig")
            .field("client_ttl", &self.client_ttl)
            .field("max_wait", &self.max_wait)
            .field("max_body_bytes", &self.max_body_bytes)
            .field("max_batch", &self.max_batch)
            .field("max_clients", &self.max_clients)
            .field("max_unanswered", &self.max_unanswered)
            .field("redeliver_after", &self.redeliver_after)
            .field("auth", &self.auth.is_some())
            .finish()
    }
}

/// Something the hypervisor should know about.
#[derive(Debug, Clone, PartialEq)]
pub enum HubEvent<R> {
    /// A client said hello (registration, or again after a reconnect).
    Hello {
        /// Who.
        client: ClientId,
        /// The metadata it sent (JSON `null` for an empty body).
        metadata: Value,
        /// Whether the hub had not heard hello from this client before.
        first: bool,
    },
    /// A client posted the result of a task.
    Result {
        /// Who.
        client: ClientId,
        /// The task answered.
        id: TaskId,
        /// The result.
        result: R,
    },
    /// A client was silent for the TTL and has been removed: reclaim what it held.
    Expired(RemovedClient),
}

/// What the hub held for a client it removed.
#[derive(Debug, Clone, PartialEq)]
pub struct RemovedClient {
    /// Who.
    pub client: ClientId,
    /// Metadata of its last hello (`null` if none).
    pub metadata: Value,
    /// When it was last seen.
    pub last_seen: SystemTime,
    /// Tasks still queued for it, never delivered.
    pub undelivered: Vec<TaskId>,
    /// Tasks delivered to it that it never answered.
    pub unanswered: Vec<TaskId>,
}

/// A snapshot of one client, from [`Hub::clients`].
#[derive(Debug, Clone, PartialEq)]
pub struct ClientInfo {
    /// Who.
    pub id: ClientId,
    /// Metadata of its last hello (`null` if none).
    pub metadata: Value,
    /// Whether it has said hello (a client can also be known from a poll, or
    /// from a task submitted for it).
    pub hello: bool,
    /// When it was last seen (now, while a long-poll is in progress).
    pub last_seen: SystemTime,
    /// How long it has been silent (zero while a long-poll is in progress).
    pub idle: Duration,
    /// Whether a long-poll of it is in progress.
    pub polling: bool,
    /// Tasks queued, not yet delivered.
    pub queued: usize,
    /// Tasks delivered, not yet answered.
    pub unanswered: usize,
}

/// Why [`Hub::submit`] failed.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// The task did not serialize to JSON.
    #[error("task does not serialize to JSON: {0}")]
    Encode(#[from] serde_json::Error),
}
