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

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, Hasher};
use std::marker::PhantomData;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant, SystemTime};

use poem::endpoint::make;
use poem::error::ReadBodyError;
use poem::http::{HeaderValue, StatusCode, header};
use poem::middleware::CatchPanic;
use poem::{EndpointExt, Request, Response, Route, get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use tokio::sync::{Notify, mpsc};

use crate::wire::{
    ClientId, ErrorBody, HelloReply, INSTANCE_HEADER, InvalidClientId, TaskId, TaskResult,
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

/// Per-client task queues shared between the hypervisor and the HTTP routes.
/// Cloning is cheap (one `Arc`).
pub struct Hub<T, R> {
    inner: Arc<Inner<R>>,
    _types: PhantomData<fn(T) -> R>,
}

impl<T, R> Clone for Hub<T, R> {
    fn clone(&self) -> Self {
        Self {
            inner: Arc::clone(&self.inner),
            _types: PhantomData,
        }
    }
}

impl<T, R> fmt::Debug for Hub<T, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hub")
            .field("instance", &self.inner.instance)
            .field("config", &self.inner.config)
            .finish_non_exhaustive()
    }
}

struct Inner<R> {
    config: HubConfig,
    instance: String,
    next_task: AtomicU64,
    clients: Mutex<HashMap<ClientId, Entry>>,
    events: mpsc::UnboundedSender<HubEvent<R>>,
    sweeper_running: AtomicBool,
}

struct Entry {
    queue: VecDeque<Queued>,
    unanswered: BTreeMap<TaskId, Delivered>,
    notify: Arc<Notify>,
    last_seen: Instant,
    active_polls: u32,
    metadata: Value,
    hello: bool,
}

struct Queued {
    id: TaskId,
    json: Arc<str>,
}

struct Delivered {
    // Kept only when redelivery is on.
    json: Option<Arc<str>>,
    at: Instant,
}

struct TooManyClients;

enum Take {
    Tasks(String),
    Wait(Arc<Notify>),
    Gone,
}

impl Entry {
    fn new(now: Instant) -> Self {
        Self {
            queue: VecDeque::new(),
            unanswered: BTreeMap::new(),
            notify: Arc::new(Notify::new()),
            last_seen: now,
            active_polls: 0,
            metadata: Value::Null,
            hello: false,
        }
    }
}

impl<T, R> Hub<T, R>
where
    T: Serialize + DeserializeOwned + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
    /// A hub and the receiver of its events. Drop the receiver to ignore events.
    pub fn new(config: HubConfig) -> (Self, HubEvents<R>) {
        let (events, rx) = mpsc::unbounded_channel();
        let inner = Arc::new(Inner {
            config,
            instance: instance_id(),
            next_task: AtomicU64::new(1),
            clients: Mutex::new(HashMap::new()),
            events,
            sweeper_running: AtomicBool::new(false),
        });
        // Outside a runtime the sweeper starts with the first request instead.
        inner.ensure_sweeper();
        let hub = Self {
            inner,
            _types: PhantomData,
        };
        (hub, rx)
    }

    /// Queues `task` for `client` and wakes its waiting long-poll. A client the
    /// hub does not know yet is created (it then expires after the TTL unless
    /// it shows up).
    pub fn submit(&self, client: &ClientId, task: T) -> Result<TaskId, SubmitError> {
        let json: Arc<str> = serde_json::to_string(&task)?.into();
        let id = TaskId(self.inner.next_task.fetch_add(1, Ordering::Relaxed));
        let mut clients = self.inner.lock();
        let entry = clients
            .entry(client.clone())
            .or_insert_with(|| Entry::new(Instant::now()));
        entry.queue.push_back(Queued { id, json });
        // notify_one stores a permit when no poll waits, so a poll that starts
        // between its queue check and its wait still wakes.
        entry.notify.notify_one();
        Ok(id)
    }

    /// Snapshot of all known clients, sorted by id.
    pub fn clients(&self) -> Vec<ClientInfo> {
        let now = Instant::now();
        let clients = self.inner.lock();
        let mut out: Vec<ClientInfo> = clients
            .iter()
            .map(|(id, entry)| info(id, entry, now))
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Snapshot of one client.
    pub fn client(&self, id: &ClientId) -> Option<ClientInfo> {
        let now = Instant::now();
        self.inner.lock().get(id).map(|entry| info(id, entry, now))
    }

    /// Removes a client now, without an event; returns what it held. A long-poll
    /// of it in progress ends at its next wake-up.
    pub fn remove_client(&self, id: &ClientId) -> Option<RemovedClient> {
        let now = Instant::now();
        let entry = self.inner.lock().remove(id)?;
        entry.notify.notify_waiters();
        Some(removed(id.clone(), entry, now))
    }

    /// Runs one expiry (and redelivery) sweep now; returns how many clients
    /// expired. The background sweeper does the same on its own.
    pub fn expire_now(&self) -> usize {
        self.inner.sweep(Instant::now())
    }

    /// This hub's instance id, sent in every response as [`INSTANCE_HEADER`].
    pub fn instance_id(&self) -> &str {
        &self.inner.instance
    }

    /// The configuration the hub runs with.
    pub fn config(&self) -> &HubConfig {
        &self.inner.config
    }

    /// The routes, relative to wherever they are nested:
    ///
    /// - `GET  /clients/{id}/tasks?wait_ms=N`: long-poll for tasks.
    /// - `POST /clients/{id}/results`: `{ "id": TaskId, "result": R }`.
    /// - `POST /clients/{id}/hello`: any JSON metadata (or an empty body).
    ///
    /// Mount with `Route::new().nest("/prefix", hub.route())`, next to the
    /// hypervisor's own routes.
    pub fn route(&self) -> Route {
        self.inner.ensure_sweeper();
        let poll = {
            let hub = self.clone();
            make(move |req| {
                let hub = hub.clone();
                async move { hub.inner.finish(hub.serve_poll(req).await) }
            })
        };
        let results = {
            let hub = self.clone();
            make(move |req| {
                let hub = hub.clone();
                async move { hub.inner.finish(hub.serve_results(req).await) }
            })
        };
        let hello = {
            let hub = self.clone();
            make(move |req| {
                let hub = hub.clone();
                async move { hub.inner.finish(hub.serve_hello(req).await) }
            })
        };
        Route::new()
            .at("/clients/:id/tasks", get(poll.with(CatchPanic::new())))
            .at(
                "/clients/:id/results",
                post(results.with(CatchPanic::new())),
            )
            .at("/clients/:id/hello", post(hello.with(CatchPanic::new())))
    }

    async fn serve_poll(&self, req: Request) -> Response {
        let id = match self.inner.admit(&req) {
            Ok(id) => id,
            Err(refusal) => return refusal.into_response(),
        };
        let wait = match parse_wait_ms(req.uri().query()) {
            Ok(ms) => Duration::from_millis(ms).min(self.inner.config.max_wait),
            Err(msg) => return json_error(StatusCode::BAD_REQUEST, msg),
        };
        if self.inner.begin_poll(&id).is_err() {
            return json_error(StatusCode::TOO_MANY_REQUESTS, "too many clients");
        }
        // Ends the poll (and marks the client seen) however this future ends,
        // including when it is dropped unfinished (server shutdown).
        let _poll = PollGuard {
            inner: &self.inner,
            id: &id,
        };
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notify = match self.inner.take(&id) {
                Take::Tasks(body) => {
                    return Response::builder()
                        .status(StatusCode::OK)
                        .content_type("application/json")
                        .body(body);
                }
                Take::Gone => return Response::builder().status(StatusCode::NO_CONTENT).finish(),
                Take::Wait(notify) => notify,
            };
            tokio::select! {
                () = notify.notified() => {}
                () = tokio::time::sleep_until(deadline) => {
                    return Response::builder().status(StatusCode::NO_CONTENT).finish();
                }
            }
        }
    }

    async fn serve_results(&self, mut req: Request) -> Response {
        let id = match self.inner.admit(&req) {
            Ok(id) => id,
            Err(refusal) => return refusal.into_response(),
        };
        let body = match self.inner.read_body(&mut req).await {
            Ok(body) => body,
            Err(refusal) => return refusal.into_response(),
        };
        let posted: TaskResult<R> = match serde_json::from_slice(&body) {
            Ok(posted) => posted,
            Err(e) => return malformed(&e),
        };
        match self.inner.answer(&id, posted.id) {
            Answer::Accepted => {
                // A dropped receiver means nobody listens; the result is discarded.
                if self
                    .inner
                    .events
                    .send(HubEvent::Result {
                        client: id,
                        id: posted.id,
                        result: posted.result,
                    })
                    .is_err()
                {
                    tracing::debug!("hub events receiver dropped; result discarded");
                }
                Response::builder().status(StatusCode::NO_CONTENT).finish()
            }
            Answer::UnknownClient => json_error(StatusCode::NOT_FOUND, "unknown client"),
            Answer::UnknownTask => json_error(
                StatusCode::NOT_FOUND,
                "unknown task id (not delivered to this client, or already answered)",
            ),
        }
    }

    async fn serve_hello(&self, mut req: Request) -> Response {
        let id = match self.inner.admit(&req) {
            Ok(id) => id,
            Err(refusal) => return refusal.into_response(),
        };
        let body = match self.inner.read_body(&mut req).await {
            Ok(body) => body,
            Err(refusal) => return refusal.into_response(),
        };
        let metadata = if body.iter().all(u8::is_ascii_whitespace) {
            Value::Null
        } else {
            match serde_json::from_slice::<Value>(&body) {
                Ok(v) => v,
                Err(e) => return malformed(&e),
            }
        };
        let first = match self.inner.hello(&id, metadata.clone()) {
            Ok(first) => first,
            Err(TooManyClients) => {
                return json_error(StatusCode::TOO_MANY_REQUESTS, "too many clients");
            }
        };
        let reply = HelloReply {
            client_id: id.clone(),
            instance: self.inner.instance.clone(),
            ttl_ms: millis(self.inner.config.client_ttl),
            max_wait_ms: millis(self.inner.config.max_wait),
        };
        if self
            .inner
            .events
            .send(HubEvent::Hello {
                client: id,
                metadata,
                first,
            })
            .is_err()
        {
            tracing::debug!("hub events receiver dropped; hello not reported");
        }
        json_response(StatusCode::OK, &reply)
    }
}

enum Answer {
    Accepted,
    UnknownClient,
    UnknownTask,
}

impl<R: Send + 'static> Inner<R> {
    fn lock(&self) -> MutexGuard<'_, HashMap<ClientId, Entry>> {
        // Nothing panics while holding the lock; if something did, the map is
        // still consistent enough to serve (every update is a single step).
        self.clients.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn ensure_sweeper(self: &Arc<Self>) {
        if self.sweeper_running.swap(true, Ordering::AcqRel) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(sweeper(Arc::downgrade(self)));
            }
            Err(_) => self.sweeper_running.store(false, Ordering::Release),
        }
    }

    fn sweep_interval(&self) -> Duration {
        let mut base = self.config.client_ttl;
        if let Some(redeliver) = self.config.redeliver_after {
            base = base.min(redeliver);
        }
        (base / 4).clamp(Duration::from_millis(5), Duration::from_secs(1))
    }

    fn sweep(&self, now: Instant) -> usize {
        let ttl = self.config.client_ttl;
        let mut gone = Vec::new();
        {
            let mut clients = self.lock();
            let expired: Vec<ClientId> = clients
                .iter()
                .filter(|(_, e)| e.active_polls == 0 && now.duration_since(e.last_seen) >= ttl)
                .map(|(id, _)| id.clone())
                .collect();
            for id in expired {
                if let Some(entry) = clients.remove(&id) {
                    gone.push(removed(id, entry, now));
                }
            }
            if let Some(after) = self.config.redeliver_after {
                for entry in clients.values_mut() {
                    requeue_stale(entry, now, after);
                }
            }
        }
        let count = gone.len();
        for client in gone {
            tracing::info!(client = %client.client, "client expired");
            if self.events.send(HubEvent::Expired(client)).is_err() {
                tracing::debug!("hub events receiver dropped; expiry not reported");
            }
        }
        count
    }

    fn admit(self: &Arc<Self>, req: &Request) -> Result<ClientId, Refusal> {
        self.ensure_sweeper();
        let raw = req.raw_path_param("id").unwrap_or_default();
        let id = ClientId::new(raw).map_err(|e: InvalidClientId| {
            Refusal::new(StatusCode::BAD_REQUEST, format!("bad client id: {e}"))
        })?;
        if let Some(auth) = &self.config.auth {
            let token = bearer(req);
            let allowed =
                catch_unwind(AssertUnwindSafe(|| auth(&id, token))).unwrap_or_else(|_| {
                    tracing::error!("authentication hook panicked; request refused");
                    false
                });
            if !allowed {
                return Err(Refusal::new(StatusCode::UNAUTHORIZED, "unauthorized"));
            }
        }
        Ok(id)
    }

    async fn read_body(&self, req: &mut Request) -> Result<Vec<u8>, Refusal> {
        let limit = self.config.max_body_bytes;
        let declared = req
            .header(header::CONTENT_LENGTH)
            .and_then(|v| v.trim().parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(too_large(limit));
        }
        match req.take_body().into_bytes_limit(limit).await {
            Ok(bytes) => Ok(bytes.to_vec()),
            Err(ReadBodyError::PayloadTooLarge) => Err(too_large(limit)),
            Err(e) => Err(Refusal::new(
                StatusCode::BAD_REQUEST,
                format!("could not read body: {e}"),
            )),
        }
    }

    fn entry_for<'a>(
        &self,
        clients: &'a mut HashMap<ClientId, Entry>,
        id: &ClientId,
        now: Instant,
    ) -> Result<&'a mut Entry, TooManyClients> {
        if !clients.contains_key(id) && clients.len() >= self.config.max_clients {
            return Err(TooManyClients);
        }
        let entry = clients.entry(id.clone()).or_insert_with(|| Entry::new(now));
        entry.last_seen = now;
        Ok(entry)
    }

    fn begin_poll(&self, id: &ClientId) -> Result<(), TooManyClients> {
        let mut clients = self.lock();
        let entry = self.entry_for(&mut clients, id, Instant::now())?;
        entry.active_polls = entry.active_polls.saturating_add(1);
        Ok(())
    }

    fn end_poll(&self, id: &ClientId) {
        if let Some(entry) = self.lock().get_mut(id) {
            entry.active_polls = entry.active_polls.saturating_sub(1);
            entry.last_seen = Instant::now();
        }
    }

    fn take(&self, id: &ClientId) -> Take {
        let mut clients = self.lock();
        let Some(entry) = clients.get_mut(id) else {
            return Take::Gone;
        };
        if entry.queue.is_empty() {
            return Take::Wait(Arc::clone(&entry.notify));
        }
        let now = Instant::now();
        let count = entry.queue.len().min(self.config.max_batch.max(1));
        let keep_json = self.config.redeliver_after.is_some();
        let mut body = String::from("[");
        for (i, task) in entry.queue.drain(..count).enumerate() {
            if i > 0 {
                body.push(',');
            }
            body.push_str("{\"id\":");
            body.push_str(&task.id.0.to_string());
            body.push_str(",\"task\":");
            body.push_str(&task.json);
            body.push('}');
            entry.unanswered.insert(
                task.id,
                Delivered {
                    json: keep_json.then_some(task.json),
                    at: now,
                },
            );
        }
        body.push(']');
        while entry.unanswered.len() > self.config.max_unanswered {
            entry.unanswered.pop_first();
        }
        Take::Tasks(body)
    }

    fn answer(&self, id: &ClientId, task: TaskId) -> Answer {
        let mut clients = self.lock();
        let Some(entry) = clients.get_mut(id) else {
            return Answer::UnknownClient;
        };
        entry.last_seen = Instant::now();
        if entry.unanswered.remove(&task).is_some() {
            return Answer::Accepted;
        }
        // A redelivered task may be answered by its first delivery's result.
        if let Some(pos) = entry.queue.iter().position(|q| q.id == task)
            && self.config.redeliver_after.is_some()
        {
            entry.queue.remove(pos);
            return Answer::Accepted;
        }
        Answer::UnknownTask
    }

    fn hello(&self, id: &ClientId, metadata: Value) -> Result<bool, TooManyClients> {
        let mut clients = self.lock();
        let entry = self.entry_for(&mut clients, id, Instant::now())?;
        let first = !entry.hello;
        entry.hello = true;
        entry.metadata = metadata;
        Ok(first)
    }

    fn finish(&self, mut resp: Response) -> Response {
        if let Ok(value) = HeaderValue::from_str(&self.instance) {
            resp.headers_mut().insert(INSTANCE_HEADER, value);
        }
        resp
    }
}

struct PollGuard<'a, R: Send + 'static> {
    inner: &'a Inner<R>,
    id: &'a ClientId,
}

impl<R: Send + 'static> Drop for PollGuard<'_, R> {
    fn drop(&mut self) {
        self.inner.end_poll(self.id);
    }
}

/// Clears the "sweeper running" flag when the sweeper task ends, including when
/// its runtime shuts down, so a later request in another runtime starts a new one.
struct SweeperGuard<R: Send + 'static>(Weak<Inner<R>>);

impl<R: Send + 'static> Drop for SweeperGuard<R> {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.sweeper_running.store(false, Ordering::Release);
        }
    }
}

async fn sweeper<R: Send + 'static>(hub: Weak<Inner<R>>) {
    let _guard = SweeperGuard(hub.clone());
    loop {
        let interval = match hub.upgrade() {
            Some(inner) => inner.sweep_interval(),
            None => return,
        };
        tokio::time::sleep(interval).await;
        match hub.upgrade() {
            Some(inner) => {
                inner.sweep(Instant::now());
            }
            None => return,
        }
    }
}

fn requeue_stale(entry: &mut Entry, now: Instant, after: Duration) {
    let stale: Vec<TaskId> = entry
        .unanswered
        .iter()
        .filter(|(_, d)| now.duration_since(d.at) >= after)
        .map(|(id, _)| *id)
        .collect();
    if stale.is_empty() {
        return;
    }
    // Oldest first, ahead of newer work.
    for id in stale.into_iter().rev() {
        if let Some(Delivered {
            json: Some(json), ..
        }) = entry.unanswered.remove(&id)
        {
            entry.queue.push_front(Queued { id, json });
        }
    }
    entry.notify.notify_one();
}

fn info(id: &ClientId, entry: &Entry, now: Instant) -> ClientInfo {
    let polling = entry.active_polls > 0;
    let idle = if polling {
        Duration::ZERO
    } else {
        now.duration_since(entry.last_seen)
    };
    ClientInfo {
        id: id.clone(),
        metadata: entry.metadata.clone(),
        hello: entry.hello,
        last_seen: system_time_ago(idle),
        idle,
        polling,
        queued: entry.queue.len(),
        unanswered: entry.unanswered.len(),
    }
}

fn removed(client: ClientId, entry: Entry, now: Instant) -> RemovedClient {
    RemovedClient {
        client,
        last_seen: system_time_ago(now.duration_since(entry.last_seen)),
        undelivered: entry.queue.iter().map(|q| q.id).collect(),
        unanswered: entry.unanswered.keys().copied().collect(),
        metadata: entry.metadata,
    }
}

fn system_time_ago(ago: Duration) -> SystemTime {
    SystemTime::now()
        .checked_sub(ago)
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A fresh id per hub, from the process's random hasher keys, the pid and the clock.
fn instance_id() -> String {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    if let Ok(t) = SystemTime::now().duration_since(SystemTime::UNIX_EPOCH) {
        h.write_u128(t.as_nanos());
    }
    format!("{:016x}", h.finish())
}

/// `wait_ms` from the query string: absent means 0; anything but a decimal
/// `u64` is an error. Other parameters are ignored.
pub(crate) fn parse_wait_ms(query: Option<&str>) -> Result<u64, &'static str> {
    let mut wait = 0;
    for pair in query.unwrap_or_default().split('&') {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key == "wait_ms" {
            if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
                return Err("wait_ms must be a non-negative integer");
            }
            // All digits: the only failure left is overflow; cap it.
            wait = value.parse::<u64>().unwrap_or(u64::MAX);
        }
    }
    Ok(wait)
}

fn bearer(req: &Request) -> Option<&str> {
    let value = req.header(header::AUTHORIZATION)?.trim();
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// A JSON response; a body that cannot be serialised is a bare 500 (logged).
/// Shared with servers that mount the hub next to their own routes.
pub fn json_response<B: Serialize>(status: StatusCode, body: &B) -> Response {
    match serde_json::to_string(body) {
        Ok(json) => Response::builder()
            .status(status)
            .content_type("application/json")
            .body(json),
        Err(e) => {
            tracing::error!(error = %e, "response did not serialize");
            Response::builder()
                .status(StatusCode::INTERNAL_SERVER_ERROR)
                .finish()
        }
    }
}

/// `{"error": message}` with `status`: every error body of the channel.
pub fn json_error(status: StatusCode, message: &str) -> Response {
    json_response(
        status,
        &ErrorBody {
            error: message.to_owned(),
        },
    )
}

fn too_large(limit: usize) -> Refusal {
    Refusal::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("body larger than {limit} bytes"),
    )
}

/// A request turned away before it reached the hub: small, unlike `Response`.
struct Refusal {
    status: StatusCode,
    message: Cow<'static, str>,
}

impl Refusal {
    fn new(status: StatusCode, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    fn into_response(self) -> Response {
        let mut resp = json_error(self.status, &self.message);
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

/// 400 for a body that is not the expected JSON, the reason cut to 200 bytes.
pub fn malformed(e: &serde_json::Error) -> Response {
    let mut msg = format!("malformed JSON: {e}");
    if msg.len() > 200 {
        let mut cut = 200;
        while !msg.is_char_boundary(cut) {
            cut -= 1;
        }
        msg.truncate(cut);
    }
    json_error(StatusCode::BAD_REQUEST, &msg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_ms_table() {
        let cases: &[(Option<&str>, Result<u64, ()>)] = &[
            (None, Ok(0)),
            (Some(""), Ok(0)),
            (Some("wait_ms=250"), Ok(250)),
            (Some("x=1&wait_ms=7&y"), Ok(7)),
            (Some("wait_ms=99999999999999999999999"), Ok(u64::MAX)),
            (Some("wait_ms="), Err(())),
            (Some("wait_ms"), Err(())),
            (Some("wait_ms=-1"), Err(())),
            (Some("wait_ms=1e3"), Err(())),
            (Some("wait_ms=%31"), Err(())),
        ];
        for (query, want) in cases {
            assert_eq!(&parse_wait_ms(*query).map_err(|_| ()), want, "{query:?}");
        }
    }

    #[test]
    fn submit_then_take_builds_the_documented_array() {
        let (hub, _events) = Hub::<String, u32>::new(HubConfig::default());
        let id = ClientId::new("c").unwrap();
        let a = hub.submit(&id, "x".to_owned()).unwrap();
        let b = hub.submit(&id, "y".to_owned()).unwrap();
        let Take::Tasks(body) = hub.inner.take(&id) else {
            panic!("expected tasks");
        };
        let parsed: Vec<crate::Task<String>> = serde_json::from_str(&body).unwrap();
        assert_eq!(parsed.len(), 2);
        assert_eq!((parsed[0].id, parsed[1].id), (a, b));
        assert_eq!(hub.client(&id).unwrap().unanswered, 2);
        assert!(matches!(hub.inner.answer(&id, a), Answer::Accepted));
        assert!(matches!(hub.inner.answer(&id, a), Answer::UnknownTask));
    }

    #[test]
    fn sweep_expires_idle_and_requeues_stale() {
        let config = HubConfig {
            client_ttl: Duration::from_secs(10),
            redeliver_after: Some(Duration::from_secs(1)),
            ..HubConfig::default()
        };
        let (hub, mut events) = Hub::<u8, u8>::new(config);
        let idle = ClientId::new("idle").unwrap();
        let busy = ClientId::new("busy").unwrap();
        let t = hub.submit(&idle, 1).unwrap();
        hub.submit(&busy, 2).unwrap();
        assert!(matches!(hub.inner.take(&busy), Take::Tasks(_)));
        hub.inner.begin_poll(&busy).ok();
        let later = Instant::now() + Duration::from_secs(11);
        assert_eq!(hub.inner.sweep(later), 1);
        let Ok(HubEvent::Expired(gone)) = events.try_recv() else {
            panic!("expected an expiry event");
        };
        assert_eq!((gone.client, gone.undelivered), (idle, vec![t]));
        // The busy client's delivered task went back to its queue.
        let info = hub.client(&busy).unwrap();
        assert_eq!((info.queued, info.unanswered, info.polling), (1, 0, true));
    }

    #[test]
    fn bearer_parsing() {
        let req = |v: &str| Request::builder().header("authorization", v).finish();
        assert_eq!(bearer(&req("Bearer abc")), Some("abc"));
        assert_eq!(bearer(&req("bearer  abc ")), Some("abc"));
        assert_eq!(bearer(&req("Basic abc")), None);
        assert_eq!(bearer(&req("Bearer ")), None);
        assert_eq!(bearer(&Request::builder().finish()), None);
    }
}
