//! The Poem routes that serve the hub, and the JSON helpers every route of
//! the hypervisor uses.

use std::borrow::Cow;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use poem::endpoint::make;
use poem::error::ReadBodyError;
use poem::http::{HeaderValue, StatusCode, header};
use poem::middleware::CatchPanic;
use poem::{EndpointExt, Request, Response, Route, get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::wire::{ClientId, ErrorBody, HelloReply, INSTANCE_HEADER, InvalidClientId, TaskResult};

use super::*;

impl<T, R> Hub<T, R>
where
    T: Serialize + DeserializeOwned + Send + 'static,
    R: Serialize + DeserializeOwned + Send + 'static,
{
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

    pub(super) async fn serve_poll(&self, req: Request) -> Response {
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

    pub(super) async fn serve_results(&self, mut req: Request) -> Response {
        let (id, body) = match self.inner.admit_with_body(&mut req).await {
            Ok(admitted) => admitted,
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

    pub(super) async fn serve_hello(&self, mut req: Request) -> Response {
        let (id, body) = match self.inner.admit_with_body(&mut req).await {
            Ok(admitted) => admitted,
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

impl<R: Send + 'static> Inner<R> {
    pub(super) fn admit(self: &Arc<Self>, req: &Request) -> Result<ClientId, Refusal> {
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

    /// The client of an admitted request, and its body.
    async fn admit_with_body(
        self: &Arc<Self>,
        req: &mut Request,
    ) -> Result<(ClientId, Vec<u8>), Refusal> {
        let id = self.admit(req)?;
        let body = read_body(req, self.config.max_body_bytes).await?;
        Ok((id, body))
    }

    pub(super) fn finish(&self, mut resp: Response) -> Response {
        if let Ok(value) = HeaderValue::from_str(&self.instance) {
            resp.headers_mut().insert(INSTANCE_HEADER, value);
        }
        resp
    }
}

pub(super) struct PollGuard<'a, R: Send + 'static> {
    pub(super) inner: &'a Inner<R>,
    pub(super) id: &'a ClientId,
}

impl<R: Send + 'static> Drop for PollGuard<'_, R> {
    fn drop(&mut self) {
        self.inner.end_poll(self.id);
    }
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

/// The token of an `Authorization: Bearer <token>` header (scheme in any
/// case, surrounding whitespace trimmed); `None` if absent, another scheme,
/// or empty. Shared with servers that mount the hub next to their own routes.
pub fn bearer(req: &Request) -> Option<&str> {
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

/// The most characters of a message an error body carries. Messages show at
/// most 200 characters of any value they quote; this bounds the body even
/// where one does not.
pub const MAX_ERROR_CHARS: usize = 1024;

/// `{"error": message}` with `status`: every error body of the channel, and
/// of the servers that mount it. A message longer than [`MAX_ERROR_CHARS`]
/// is cut there, and says how much was left out.
pub fn json_error(status: StatusCode, message: &str) -> Response {
    let error = match message.char_indices().nth(MAX_ERROR_CHARS) {
        Some((at, _)) => format!(
            "{}… ({} more characters)",
            &message[..at],
            message[at..].chars().count()
        ),
        None => message.to_owned(),
    };
    json_response(status, &ErrorBody { error })
}

pub(super) fn too_large(limit: usize) -> Refusal {
    Refusal::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        format!("body larger than {limit} bytes"),
    )
}

/// A request turned away before it reached its handler: small, unlike
/// `Response`. Shared with servers that mount the hub next to their own routes.
#[derive(Debug)]
pub struct Refusal {
    status: StatusCode,
    message: Cow<'static, str>,
}

impl Refusal {
    /// `status` with `{"error": message}`.
    pub fn new(status: StatusCode, message: impl Into<Cow<'static, str>>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }

    /// 401 `unauthorized`.
    pub fn unauthorized() -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "unauthorized")
    }

    /// The JSON error response; a 401 also carries `WWW-Authenticate: Bearer`.
    pub fn into_response(self) -> Response {
        let mut resp = json_error(self.status, &self.message);
        if self.status == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}

/// The request's body, up to `limit` bytes (413 beyond, checked against the
/// declared length first).
pub async fn read_body(req: &mut Request, limit: usize) -> Result<Vec<u8>, Refusal> {
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
    fn long_error_messages_are_cut() {
        let body = |message: &str| {
            let resp = json_error(StatusCode::BAD_REQUEST, message);
            let runtime = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            let bytes = runtime.block_on(resp.into_body().into_vec()).unwrap();
            let body: ErrorBody = serde_json::from_slice(&bytes).unwrap();
            body.error
        };
        assert_eq!(body("no such pod"), "no such pod");
        let long = "é".repeat(MAX_ERROR_CHARS + 3);
        let cut = body(&long);
        assert!(cut.ends_with("é… (3 more characters)"), "{cut}");
        assert_eq!(cut.chars().filter(|c| *c == 'é').count(), MAX_ERROR_CHARS);
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
