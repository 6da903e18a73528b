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
//!
//! [`http`] holds the hardened agent and [`Requester`] (plain JSON requests),
//! [`poll_loop`] the loop a [`Client`] runs, [`backoff`] its retry delays.

mod backoff;
mod http;
mod poll_loop;
mod unix;

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;
use ureq::http::HeaderValue;

use crate::wire::{ClientId, HelloReply, InvalidClientId, Task, TaskId};

pub use backoff::Backoff;
pub use http::Requester;
use http::*;
pub use poll_loop::LoopHandle;

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
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) agent: ureq::Agent,
    pub(super) base: http::Target,
    pub(super) id: ClientId,
    pub(super) auth: Option<HeaderValue>,
    pub(super) opts: ClientOptions,
    // Shared with loops spawned from this client, which re-send it after a reconnect.
    pub(super) metadata: Arc<Mutex<Value>>,
}

pub(super) struct Reply {
    pub(super) status: u16,
    pub(super) instance: Option<String>,
    pub(super) body: Vec<u8>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("base", &self.inner.base.given)
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
        let auth = bearer(options.token.as_deref())?;
        Ok(Self {
            inner: Arc::new(Inner {
                agent: build_agent(&options, base.socket.as_deref()),
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

    pub(super) fn send_hello(&self, metadata: &Value) -> Result<HelloReply, ChannelError> {
        let body = serde_json::to_vec(metadata).map_err(ChannelError::Encode)?;
        let reply = self.post("hello", &body)?;
        if reply.status != 200 {
            return Err(status_error(&reply));
        }
        serde_json::from_slice(&reply.body)
            .map_err(|source| ChannelError::Decode { task: None, source })
    }

    /// Long-polls; returns the tasks undecoded and the hub's instance id.
    pub(super) fn fetch(
        &self,
        wait: Duration,
    ) -> Result<(Vec<Task<Value>>, Option<String>), ChannelError> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let url = format!(
            "{}/clients/{}/tasks?wait_ms={wait_ms}",
            self.inner.base.request, self.inner.id
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
        let reply = read(req.call(), &self.inner.opts)?;
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
        let url = format!(
            "{}/clients/{}/{what}",
            self.inner.base.request, self.inner.id
        );
        let inner = &self.inner;
        let timeout = inner.opts.request_timeout;
        post(
            &inner.agent,
            &url,
            inner.auth.as_ref(),
            timeout,
            body,
            &inner.opts,
        )
    }

    pub(super) fn metadata(&self) -> Value {
        self.inner
            .metadata
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
