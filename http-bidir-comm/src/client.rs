//! Client side: blocking, on `ureq`, for code injected into someone else's
//! process. No async runtime, no panics, every call bounded in time.
//!
//! Hazards handled here, because the host program is not ours:
//! - proxies from the environment (`HTTP_PROXY`, ...) are ignored: the hub is
//!   node-local and an application's proxy must not see (or break) this traffic;
//! - redirects are not followed;
//! - every request has a connect timeout and an overall timeout; a response
//!   body is read up to a size limit;
//! - [`LoopHandle::stop`] shuts the loop's sockets down, so a long-poll in
//!   progress ends at once instead of after its wait.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use ureq::http::{HeaderValue, Uri};

use crate::wire::{
    ClientId, ErrorBody, HelloReply, INSTANCE_HEADER, InvalidClientId, Task, TaskId,
};

/// Client tuning. `ClientOptions::default()` suits a node-local hub.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientOptions {
    /// Sent as `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// How long one long-poll asks the server to wait (the server may cap it).
    pub long_poll_wait: Duration,
    /// Overall limit of a hello or result request; a long-poll gets
    /// `long_poll_wait + request_timeout`.
    pub request_timeout: Duration,
    /// Limit on establishing the TCP connection. Bounds [`LoopHandle::stop`]
    /// too: a connect in progress is the one thing a stop cannot cut short.
    pub connect_timeout: Duration,
    /// First delay before retrying after a failure.
    pub backoff_min: Duration,
    /// Largest delay between retries (the delay doubles up to this; each is
    /// jittered down to between half and all of it).
    pub backoff_max: Duration,
    /// Largest response body accepted.
    pub max_response_bytes: u64,
    /// How long [`LoopHandle::stop`] waits for the loop thread before it
    /// leaves it detached (a handler still running is not interrupted).
    pub stop_timeout: Duration,
}

impl Default for ClientOptions {
    fn default() -> Self {
        Self {
            token: None,
            long_poll_wait: Duration::from_secs(25),
            request_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(1),
            backoff_min: Duration::from_millis(100),
            backoff_max: Duration::from_secs(5),
            max_response_bytes: 16 * 1024 * 1024,
            stop_timeout: Duration::from_secs(3),
        }
    }
}

/// Everything that can go wrong on the client side.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    /// The client id is not valid.
    #[error("invalid client id: {0}")]
    InvalidClientId(#[from] InvalidClientId),
    /// The base URL is not a usable `http://` URL.
    #[error("invalid base url {url:?}: {reason}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// Why it is refused.
        reason: &'static str,
    },
    /// The token cannot be sent in an HTTP header.
    #[error("token holds characters not allowed in an HTTP header")]
    InvalidToken,
    /// The server could not be reached, or the connection broke.
    #[error("transport: {0}")]
    Transport(#[source] ureq::Error),
    /// A connect, request or response took longer than its limit.
    #[error("request timed out")]
    Timeout,
    /// The server answered with an unexpected status.
    #[error("server answered {status}: {message}")]
    Status {
        /// The HTTP status code.
        status: u16,
        /// The server's `error` message, or the start of its body.
        message: String,
    },
    /// A request body did not serialize.
    #[error("could not encode request: {0}")]
    Encode(#[source] serde_json::Error),
    /// A response did not parse (for a task: it does not fit `T`).
    #[error("could not decode response{}: {source}", task.map(|t| format!(" (task {t})")).unwrap_or_default())]
    Decode {
        /// The task that did not decode, if the envelope itself was fine.
        task: Option<TaskId>,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The response body was larger than [`ClientOptions::max_response_bytes`].
    #[error("response larger than {0} bytes")]
    ResponseTooLarge(u64),
    /// The loop thread could not be started.
    #[error("could not start the client loop thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// The loop thread did not end within the limit; it was left detached and
    /// ends on its own when its current call returns.
    #[error("client loop did not stop within {0:?}; left detached")]
    StopTimeout(Duration),
    /// The loop thread panicked outside the handler (a bug).
    #[error("client loop thread panicked")]
    LoopPanicked,
}

impl ChannelError {
    /// Whether this is the server being away (unreachable, timed out, 5xx)
    /// rather than a refusal: worth retrying after a delay.
    pub fn is_retryable(&self) -> bool {
        match self {
            Self::Transport(_) | Self::Timeout | Self::ResponseTooLarge(_) => true,
            Self::Status { status, .. } => *status >= 500 || *status == 429,
            _ => false,
        }
    }

    /// The HTTP status, for [`ChannelError::Status`].
    pub fn status(&self) -> Option<u16> {
        match self {
            Self::Status { status, .. } => Some(*status),
            _ => None,
        }
    }

    fn from_ureq(e: ureq::Error) -> Self {
        match e {
            ureq::Error::Timeout(_) => Self::Timeout,
            ureq::Error::BodyExceedsLimit(n) => Self::ResponseTooLarge(n),
            other => Self::Transport(other),
        }
    }
}

/// A blocking client of one hub, as one client id. Cloning is cheap; clones
/// share connections.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

struct Inner {
    agent: ureq::Agent,
    base: String,
    id: ClientId,
    auth: Option<HeaderValue>,
    opts: ClientOptions,
    // Shared with loops spawned from this client, which re-send it after a reconnect.
    metadata: Arc<Mutex<Value>>,
}

struct Reply {
    status: u16,
    instance: Option<String>,
    body: Vec<u8>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.inner.base)
            .field("id", &self.inner.id)
            .finish_non_exhaustive()
    }
}

impl Client {
    /// A client of the hub mounted at `base_url` (e.g.
    /// `http://127.0.0.1:8000/api/v1`, where `/clients/...` is nested). Makes no
    /// request.
    pub fn new(
        base_url: &str,
        client_id: &str,
        options: ClientOptions,
    ) -> Result<Self, ChannelError> {
        let id = ClientId::new(client_id)?;
        let base = check_base_url(base_url)?;
        let auth = match &options.token {
            Some(token) => Some(
                HeaderValue::from_str(&format!("Bearer {token}"))
                    .map_err(|_| ChannelError::InvalidToken)?,
            ),
            None => None,
        };
        Ok(Self {
            inner: Arc::new(Inner {
                agent: build_agent(&options),
                base,
                id,
                auth,
                opts: options,
                metadata: Arc::new(Mutex::new(Value::Null)),
            }),
        })
    }

    /// The client id.
    pub fn id(&self) -> &ClientId {
        &self.inner.id
    }

    /// The options the client runs with.
    pub fn options(&self) -> &ClientOptions {
        &self.inner.opts
    }

    /// Registers with the hub (or heartbeats). The metadata is kept and sent
    /// again by a running loop after each reconnect.
    pub fn hello<M: Serialize + ?Sized>(&self, metadata: &M) -> Result<HelloReply, ChannelError> {
        let value = serde_json::to_value(metadata).map_err(ChannelError::Encode)?;
        *self
            .inner
            .metadata
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = value.clone();
        self.send_hello(&value)
    }

    /// Posts the result of task `id`.
    pub fn post_result<R: Serialize + ?Sized>(
        &self,
        id: TaskId,
        result: &R,
    ) -> Result<(), ChannelError> {
        #[derive(Serialize)]
        struct Posted<'a, R: ?Sized> {
            id: TaskId,
            result: &'a R,
        }
        let body = serde_json::to_vec(&Posted { id, result }).map_err(ChannelError::Encode)?;
        let reply = self.post("results", &body)?;
        if (200..300).contains(&reply.status) {
            Ok(())
        } else {
            Err(status_error(&reply))
        }
    }

    /// One long-poll of [`ClientOptions::long_poll_wait`]: the tasks queued for
    /// this client, or an empty list when none came in time. Delivered tasks
    /// are gone from the server's queue: a task that does not decode as `T`
    /// fails the whole call with [`ChannelError::Decode`].
    pub fn poll_once<T: DeserializeOwned>(&self) -> Result<Vec<Task<T>>, ChannelError> {
        self.poll_wait(self.inner.opts.long_poll_wait)
    }

    /// [`Client::poll_once`] with an explicit wait (zero: do not wait).
    pub fn poll_wait<T: DeserializeOwned>(
        &self,
        wait: Duration,
    ) -> Result<Vec<Task<T>>, ChannelError> {
        let (tasks, _) = self.fetch(wait)?;
        tasks
            .into_iter()
            .map(|raw| {
                serde_json::from_value(raw.task)
                    .map(|task| Task { id: raw.id, task })
                    .map_err(|source| ChannelError::Decode {
                        task: Some(raw.id),
                        source,
                    })
            })
            .collect()
    }

    /// Runs the client on its own thread: hello, then long-poll; each task goes
    /// to `handler` and its return value is posted as the result. When the hub
    /// is away, it retries with jittered exponential backoff and says hello
    /// again once back (also when the hub restarted between two polls, seen
    /// from its instance id). A handler that panics gets no result posted; the
    /// loop goes on. A task that does not decode as `T` is skipped (logged).
    ///
    /// The loop has its own connections, so stopping it does not affect this
    /// client.
    pub fn spawn_loop<T, R, F>(&self, handler: F) -> Result<LoopHandle, ChannelError>
    where
        T: DeserializeOwned + Send + 'static,
        R: Serialize + Send + 'static,
        F: FnMut(Task<T>) -> R + Send + 'static,
    {
        let client = Self {
            inner: Arc::new(Inner {
                agent: build_agent(&self.inner.opts),
                base: self.inner.base.clone(),
                id: self.inner.id.clone(),
                auth: self.inner.auth.clone(),
                opts: self.inner.opts.clone(),
                metadata: Arc::clone(&self.inner.metadata),
            }),
        };
        let agent = client.inner.agent.clone();
        let stop = Arc::new(StopSignal::default());
        let (done_tx, done_rx) = mpsc::channel::<()>();
        let join = thread::Builder::new()
            .name("bidir-client".to_owned())
            .spawn({
                let stop = Arc::clone(&stop);
                move || {
                    // Dropped when the thread ends, however it ends: that is the
                    // "done" signal stop() waits for.
                    let _done = done_tx;
                    let run = catch_unwind(AssertUnwindSafe(|| run_loop(&client, &stop, handler)));
                    if run.is_err() {
                        tracing::error!(client = %client.inner.id, "client loop panicked; stopped");
                    }
                }
            })
            .map_err(ChannelError::Spawn)?;
        Ok(LoopHandle {
            stop,
            agent: Some(agent),
            join: Some(join),
            done: done_rx,
            stop_timeout: self.inner.opts.stop_timeout,
            detached: false,
        })
    }

    fn send_hello(&self, metadata: &Value) -> Result<HelloReply, ChannelError> {
        let body = serde_json::to_vec(metadata).map_err(ChannelError::Encode)?;
        let reply = self.post("hello", &body)?;
        if reply.status != 200 {
            return Err(status_error(&reply));
        }
        serde_json::from_slice(&reply.body)
            .map_err(|source| ChannelError::Decode { task: None, source })
    }

    /// Long-polls; returns the tasks undecoded and the hub's instance id.
    fn fetch(&self, wait: Duration) -> Result<(Vec<Task<Value>>, Option<String>), ChannelError> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let url = format!(
            "{}/clients/{}/tasks?wait_ms={wait_ms}",
            self.inner.base, self.inner.id
        );
        let timeout = wait.saturating_add(self.inner.opts.request_timeout);
        let mut req = self
            .inner
            .agent
            .get(&url)
            .config()
            .timeout_global(Some(timeout))
            .build();
        if let Some(auth) = &self.inner.auth {
            req = req.header("authorization", auth.clone());
        }
        let reply = self.read(req.call())?;
        match reply.status {
            200 => {
                let tasks = serde_json::from_slice(&reply.body)
                    .map_err(|source| ChannelError::Decode { task: None, source })?;
                Ok((tasks, reply.instance))
            }
            204 => Ok((Vec::new(), reply.instance)),
            _ => Err(status_error(&reply)),
        }
    }

    fn post(&self, what: &str, body: &[u8]) -> Result<Reply, ChannelError> {
        let url = format!("{}/clients/{}/{what}", self.inner.base, self.inner.id);
        let mut req = self
            .inner
            .agent
            .post(&url)
            .config()
            .timeout_global(Some(self.inner.opts.request_timeout))
            .build()
            .content_type("application/json");
        if let Some(auth) = &self.inner.auth {
            req = req.header("authorization", auth.clone());
        }
        self.read(req.send(body))
    }

    fn read(
        &self,
        sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    ) -> Result<Reply, ChannelError> {
        let mut resp = sent.map_err(ChannelError::from_ureq)?;
        let status = resp.status().as_u16();
        let instance = resp
            .headers()
            .get(INSTANCE_HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let body = resp
            .body_mut()
            .with_config()
            .limit(self.inner.opts.max_response_bytes)
            .read_to_vec()
            .map_err(ChannelError::from_ureq)?;
        Ok(Reply {
            status,
            instance,
            body,
        })
    }

    fn metadata(&self) -> Value {
        self.inner
            .metadata
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// Handle of a loop started by [`Client::spawn_loop`]. Dropping it asks the
/// loop to stop without waiting; [`LoopHandle::detach`] leaves it running.
#[derive(Debug)]
pub struct LoopHandle {
    stop: Arc<StopSignal>,
    agent: Option<ureq::Agent>,
    join: Option<JoinHandle<()>>,
    done: mpsc::Receiver<()>,
    stop_timeout: Duration,
    detached: bool,
}

impl LoopHandle {
    /// Stops the loop and joins its thread, waiting at most
    /// [`ClientOptions::stop_timeout`]. A long-poll or request in progress is
    /// cut short at once; a handler call in progress is waited for.
    pub fn stop(self) -> Result<(), ChannelError> {
        let limit = self.stop_timeout;
        self.stop_within(limit)
    }

    /// [`LoopHandle::stop`] with an explicit limit. Past it the thread is left
    /// detached (it ends by itself once its current call returns) and
    /// [`ChannelError::StopTimeout`] is returned.
    pub fn stop_within(mut self, limit: Duration) -> Result<(), ChannelError> {
        self.signal();
        match self.done.recv_timeout(limit) {
            Err(RecvTimeoutError::Timeout) => {
                self.join.take();
                Err(ChannelError::StopTimeout(limit))
            }
            Ok(()) | Err(RecvTimeoutError::Disconnected) => match self.join.take() {
                Some(join) => join.join().map_err(|_| ChannelError::LoopPanicked),
                None => Ok(()),
            },
        }
    }

    /// Whether the loop thread has ended.
    pub fn is_finished(&self) -> bool {
        self.join.as_ref().is_none_or(JoinHandle::is_finished)
    }

    /// Lets the loop run for the rest of the process, without a handle.
    pub fn detach(mut self) {
        self.detached = true;
    }

    fn signal(&mut self) {
        self.stop.set();
        if let Some(agent) = self.agent.take() {
            // Interrupts a blocked read or write on the loop's sockets.
            agent.shutdown();
        }
    }
}

impl Drop for LoopHandle {
    fn drop(&mut self) {
        if !self.detached {
            self.signal();
        }
    }
}

#[derive(Debug, Default)]
struct StopSignal {
    stopped: Mutex<bool>,
    cv: Condvar,
}

impl StopSignal {
    fn set(&self) {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.cv.notify_all();
    }

    fn is_set(&self) -> bool {
        *self.stopped.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sleeps up to `d`; true as soon as the stop is set.
    fn wait(&self, d: Duration) -> bool {
        let deadline = Instant::now() + d;
        let mut stopped = self.stopped.lock().unwrap_or_else(PoisonError::into_inner);
        while !*stopped {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            stopped = self
                .cv
                .wait_timeout(stopped, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        *stopped
    }
}

/// Jittered exponential backoff ("equal jitter": half fixed, half random), so
/// that many clients of a restarted hub do not come back in one burst.
#[derive(Debug)]
pub(crate) struct Backoff {
    min: Duration,
    max: Duration,
    current: Duration,
    rng: u64,
}

impl Backoff {
    pub(crate) fn new(min: Duration, max: Duration, seed: u64) -> Self {
        let min = min.max(Duration::from_millis(1));
        let max = max.max(min);
        Self {
            min,
            max,
            current: min,
            rng: seed | 1,
        }
    }

    pub(crate) fn reset(&mut self) {
        self.current = self.min;
    }

    pub(crate) fn next_delay(&mut self) -> Duration {
        let base = self.current;
        self.current = self.current.saturating_mul(2).min(self.max);
        // xorshift64: plenty for jitter.
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        let half = base / 2;
        let span = u64::try_from(half.as_micros()).unwrap_or(u64::MAX).max(1);
        half + Duration::from_micros(self.rng % (span + 1))
    }
}

fn run_loop<T, R, F>(client: &Client, stop: &StopSignal, mut handler: F)
where
    T: DeserializeOwned,
    R: Serialize,
    F: FnMut(Task<T>) -> R,
{
    let opts = &client.inner.opts;
    let mut backoff = Backoff::new(opts.backoff_min, opts.backoff_max, seed(&client.inner.id));
    let mut link = Link::default();
    let mut hello_instance: Option<String> = None;
    let mut need_hello = true;
    while !stop.is_set() {
        if need_hello {
            match client.send_hello(&client.metadata()) {
                Ok(reply) => {
                    need_hello = false;
                    hello_instance = Some(reply.instance);
                    backoff.reset();
                    link.up(&client.inner.id);
                }
                Err(e) => {
                    link.down(&client.inner.id, "hello", &e, stop);
                    if stop.wait(backoff.next_delay()) {
                        break;
                    }
                    continue;
                }
            }
        }
        let (tasks, instance) = match client.fetch(opts.long_poll_wait) {
            Ok(got) => got,
            Err(e) => {
                link.down(&client.inner.id, "poll", &e, stop);
                need_hello = true;
                if stop.wait(backoff.next_delay()) {
                    break;
                }
                continue;
            }
        };
        backoff.reset();
        if instance.is_some() && instance != hello_instance {
            tracing::info!(client = %client.inner.id, "hub restarted; saying hello again");
            need_hello = true;
        }
        for raw in tasks {
            if stop.is_set() {
                break;
            }
            let id = raw.id;
            let task = match serde_json::from_value::<T>(raw.task) {
                Ok(task) => task,
                Err(e) => {
                    tracing::warn!(client = %client.inner.id, task = %id, error = %e, "task does not decode; skipped");
                    continue;
                }
            };
            let Ok(result) = catch_unwind(AssertUnwindSafe(|| handler(Task { id, task }))) else {
                tracing::error!(client = %client.inner.id, task = %id, "task handler panicked; no result posted");
                continue;
            };
            if !deliver(client, stop, &mut backoff, id, &result) {
                need_hello = true;
            }
        }
    }
}

/// Posts one result, retrying while the hub is away (a few times, with
/// backoff). False if it could not be delivered.
fn deliver<R: Serialize>(
    client: &Client,
    stop: &StopSignal,
    backoff: &mut Backoff,
    id: TaskId,
    result: &R,
) -> bool {
    const ATTEMPTS: u32 = 4;
    for attempt in 1..=ATTEMPTS {
        match client.post_result(id, result) {
            Ok(()) => return true,
            Err(e) if e.is_retryable() && attempt < ATTEMPTS && !stop.is_set() => {
                tracing::debug!(client = %client.inner.id, task = %id, error = %e, "posting result failed; retrying");
                if stop.wait(backoff.next_delay()) {
                    return false;
                }
            }
            Err(e) => {
                tracing::warn!(client = %client.inner.id, task = %id, error = %e, "result not delivered");
                return false;
            }
        }
    }
    false
}

/// Logs a lost connection once, then quietly until it is back.
#[derive(Default)]
struct Link {
    down_since: Option<Instant>,
}

impl Link {
    fn down(&mut self, id: &ClientId, what: &str, e: &ChannelError, stop: &StopSignal) {
        if stop.is_set() {
            return;
        }
        if self.down_since.is_none() {
            self.down_since = Some(Instant::now());
            tracing::warn!(client = %id, error = %e, "{what} failed; retrying with backoff");
        } else {
            tracing::debug!(client = %id, error = %e, "{what} failed again");
        }
    }

    fn up(&mut self, id: &ClientId) {
        if let Some(since) = self.down_since.take() {
            tracing::info!(client = %id, after = ?since.elapsed(), "hub reachable again");
        }
    }
}

fn seed(id: &ClientId) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write(id.as_str().as_bytes());
    h.write_u32(std::process::id());
    h.finish()
}

fn build_agent(opts: &ClientOptions) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .timeout_connect(Some(opts.connect_timeout))
        .timeout_global(Some(opts.request_timeout))
        .user_agent(concat!("http-bidir-comm/", env!("CARGO_PKG_VERSION")))
        .build()
        .new_agent()
}

fn check_base_url(url: &str) -> Result<String, ChannelError> {
    let bad = |reason| ChannelError::InvalidUrl {
        url: url.to_owned(),
        reason,
    };
    let base = url.trim_end_matches('/');
    let uri: Uri = base.parse().map_err(|_| bad("not a URL"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err(bad("https is not supported (built without TLS)")),
        _ => return Err(bad("scheme must be http://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if uri.query().is_some() {
        return Err(bad("a base URL takes no query"));
    }
    Ok(base.to_owned())
}

fn status_error(reply: &Reply) -> ChannelError {
    let message = serde_json::from_slice::<ErrorBody>(&reply.body)
        .map(|b| b.error)
        .unwrap_or_else(|_| {
            let text = String::from_utf8_lossy(&reply.body);
            text.chars().take(200).collect()
        });
    ChannelError::Status {
        status: reply.status,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_with_jitter_and_caps() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_millis(800), 42);
        let bases = [100, 200, 400, 800, 800, 800];
        for base in bases {
            let d = b.next_delay();
            let base = Duration::from_millis(base);
            assert!(
                d >= base / 2 && d <= base,
                "{d:?} not in [{:?}, {base:?}]",
                base / 2
            );
        }
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn backoff_tolerates_zero_and_inverted_bounds() {
        let mut b = Backoff::new(Duration::ZERO, Duration::ZERO, 0);
        assert!(b.next_delay() <= Duration::from_millis(1));
        let mut b = Backoff::new(Duration::from_secs(2), Duration::from_secs(1), 7);
        assert!(b.next_delay() <= Duration::from_secs(2));
    }

    #[test]
    fn base_url_table() {
        let ok = [
            "http://127.0.0.1:8000",
            "http://localhost:1/api/v1/",
            "http://[::1]:9",
        ];
        for url in ok {
            assert!(check_base_url(url).is_ok(), "{url}");
        }
        assert_eq!(check_base_url("http://h:1/api/").unwrap(), "http://h:1/api");
        let bad = [
            "",
            "127.0.0.1:8000",
            "https://h",
            "ftp://h",
            "http://h/?x=1",
            "http:// h",
        ];
        for url in bad {
            assert!(check_base_url(url).is_err(), "{url}");
        }
    }

    #[test]
    fn new_validates_id_and_token() {
        let opts = ClientOptions::default();
        assert!(matches!(
            Client::new("http://h:1", "a/b", opts.clone()),
            Err(ChannelError::InvalidClientId(_))
        ));
        let bad_token = ClientOptions {
            token: Some("a\nb".to_owned()),
            ..opts.clone()
        };
        assert!(matches!(
            Client::new("http://h:1", "a", bad_token),
            Err(ChannelError::InvalidToken)
        ));
        assert!(Client::new("http://h:1", "a", opts).is_ok());
    }

    #[test]
    fn stop_signal_wakes_a_sleeper() {
        let stop = Arc::new(StopSignal::default());
        let sleeper = {
            let stop = Arc::clone(&stop);
            thread::spawn(move || {
                let t = Instant::now();
                (stop.wait(Duration::from_secs(10)), t.elapsed())
            })
        };
        thread::sleep(Duration::from_millis(20));
        stop.set();
        let (stopped, took) = sleeper.join().unwrap();
        assert!(stopped && took < Duration::from_secs(2));
    }
}
