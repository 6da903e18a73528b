//! The client's HTTP layer: one hardened agent (no proxy, no redirects,
//! bounded time and size), and [`Requester`] for the plain JSON requests a
//! process makes besides the channel.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;
use serde::de::DeserializeOwned;
use ureq::http::{HeaderValue, Uri};

use super::{ChannelError, ClientOptions, Reply};
use crate::wire::{ErrorBody, INSTANCE_HEADER};

/// Plain JSON requests to the server the channel lives on (e.g. registering
/// before the channel's client id is known), on the same hardened agent:
/// no proxy, no redirects, bounded connect, request and response size.
#[derive(Debug, Clone)]
pub struct Requester {
    agent: ureq::Agent,
    base: Target,
    auth: Option<HeaderValue>,
    opts: ClientOptions,
}

impl Requester {
    /// Requests to paths below `base_url` (`http://`, or `http+unix://` and
    /// a socket, [`crate::unix`]), with [`ClientOptions::token`] as bearer
    /// token. Makes no request.
    pub fn new(base_url: &str, options: ClientOptions) -> Result<Self, ChannelError> {
        let base = check_base_url(base_url)?;
        Ok(Self {
            agent: build_agent(&options, base.socket.as_deref()),
            base,
            auth: bearer(options.token.as_deref())?,
            opts: options,
        })
    }

    /// The base URL, without a trailing `/`.
    pub fn base_url(&self) -> &str {
        &self.base.given
    }

    /// `POST {base}{path}` with `body` as JSON; a 2xx answer decodes as `R`,
    /// any other is [`ChannelError::Status`]. `timeout` replaces
    /// [`ClientOptions::request_timeout`] for this request.
    pub fn post_json<B: Serialize + ?Sized, R: DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
        timeout: Option<Duration>,
    ) -> Result<R, ChannelError> {
        let body = serde_json::to_vec(body).map_err(ChannelError::Encode)?;
        let url = format!("{}{path}", self.base.request);
        let timeout = timeout.unwrap_or(self.opts.request_timeout);
        let reply = post(
            &self.agent,
            &url,
            self.auth.as_ref(),
            timeout,
            &body,
            &self.opts,
        )?;
        if !(200..300).contains(&reply.status) {
            return Err(status_error(&reply));
        }
        serde_json::from_slice(&reply.body)
            .map_err(|source| ChannelError::Decode { task: None, source })
    }
}

/// `Authorization: Bearer <token>`, checked once.
pub(super) fn bearer(token: Option<&str>) -> Result<Option<HeaderValue>, ChannelError> {
    token
        .map(|token| {
            HeaderValue::from_str(&format!("Bearer {token}"))
                .map_err(|_| ChannelError::InvalidToken)
        })
        .transpose()
}

/// A JSON `POST`, bounded by `timeout`, its answer read up to the size limit.
pub(super) fn post(
    agent: &ureq::Agent,
    url: &str,
    auth: Option<&HeaderValue>,
    timeout: Duration,
    body: &[u8],
    opts: &ClientOptions,
) -> Result<Reply, ChannelError> {
    let mut req = agent
        .post(url)
        .config()
        .timeout_global(Some(timeout))
        .build()
        .content_type("application/json");
    if let Some(auth) = auth {
        req = req.header("authorization", auth.clone());
    }
    read(req.send(body), opts)
}

/// The status, instance header and body (up to the size limit) of an answer.
pub(super) fn read(
    sent: Result<ureq::http::Response<ureq::Body>, ureq::Error>,
    opts: &ClientOptions,
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
        .limit(opts.max_response_bytes)
        .read_to_vec()
        .map_err(ChannelError::from_ureq)?;
    Ok(Reply {
        status,
        instance,
        body,
    })
}

/// The agent of a client: on TCP, or on the Unix socket `socket`.
pub(super) fn build_agent(opts: &ClientOptions, socket: Option<&Path>) -> ureq::Agent {
    let config = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .proxy(None)
        .max_redirects(0)
        .timeout_connect(Some(opts.connect_timeout))
        .timeout_global(Some(opts.request_timeout))
        .user_agent(concat!("http-bidir-comm/", env!("CARGO_PKG_VERSION")))
        .build();
    match socket {
        None => config.new_agent(),
        Some(socket) => ureq::Agent::with_parts(
            config,
            super::unix::UnixConnector(socket.to_owned()),
            super::unix::NoLookup,
        ),
    }
}

/// Where a client's requests go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    /// The base URL as given, without a trailing `/`.
    pub(super) given: String,
    /// What request URLs start with: `given`, or for a Unix socket a
    /// placeholder host and the base's path.
    pub(super) request: String,
    /// The Unix socket every request connects to.
    pub(super) socket: Option<PathBuf>,
}

pub(super) fn check_base_url(url: &str) -> Result<Target, ChannelError> {
    let bad = |reason| ChannelError::InvalidUrl {
        url: url.to_owned(),
        reason,
    };
    let base = url.trim_end_matches('/');
    if base.starts_with(crate::unix::UNIX_SCHEME) {
        let (socket, path) = crate::unix::split_unix_url(base)
            .ok_or_else(|| bad("http+unix:// takes a percent-encoded absolute socket path"))?;
        if path.contains(['?', '#']) {
            return Err(bad("a base URL takes no query"));
        }
        let path = path.trim_end_matches('/');
        return Ok(Target {
            given: base.to_owned(),
            request: format!("{}{path}", super::unix::PLACEHOLDER_BASE),
            socket: Some(socket),
        });
    }
    let uri: Uri = base.parse().map_err(|_| bad("not a URL"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => return Err(bad("https is not supported (built without TLS)")),
        _ => return Err(bad("scheme must be http:// or http+unix://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(bad("no host"));
    }
    if uri.query().is_some() {
        return Err(bad("a base URL takes no query"));
    }
    Ok(Target {
        given: base.to_owned(),
        request: base.to_owned(),
        socket: None,
    })
}

pub(super) fn status_error(reply: &Reply) -> ChannelError {
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
    fn base_url_table() {
        let ok = [
            "http://127.0.0.1:8000",
            "http://localhost:1/api/v1/",
            "http://[::1]:9",
        ];
        for url in ok {
            assert!(check_base_url(url).is_ok(), "{url}");
        }
        assert_eq!(
            check_base_url("http://h:1/api/").unwrap().given,
            "http://h:1/api"
        );
        let unix = check_base_url("http+unix://%2Frun%2Fhv.sock/api/v1/").unwrap();
        assert_eq!(unix.given, "http+unix://%2Frun%2Fhv.sock/api/v1");
        assert_eq!(unix.request, "http://localhost/api/v1");
        assert_eq!(unix.socket.as_deref(), Some(Path::new("/run/hv.sock")));
        let bare = check_base_url("http+unix://%2Frun%2Fhv.sock").unwrap();
        assert_eq!(bare.request, "http://localhost");
        let bad = [
            "",
            "127.0.0.1:8000",
            "https://h",
            "ftp://h",
            "http://h/?x=1",
            "http:// h",
            "http+unix://relative.sock",
            "http+unix://%2Frun%2Fhv.sock/api?x=1",
            "unix:///run/hv.sock",
        ];
        for url in bad {
            assert!(check_base_url(url).is_err(), "{url}");
        }
    }
}
