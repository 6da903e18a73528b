//! Every refusal the routes make, with its status and error body.

use crate::common;

use common::{PREFIX, TestServer, agent, fast_options, raw_status};
use http_bidir_comm::{ChannelError, Client, ClientOptions, ErrorBody, Hub, HubConfig};
use serde_json::json;

fn status_and_error(resp: ureq::http::Response<ureq::Body>) -> (u16, Option<String>) {
    let status = resp.status().as_u16();
    let body = resp.into_body().read_to_vec().unwrap_or_default();
    let error = serde_json::from_slice::<ErrorBody>(&body)
        .ok()
        .map(|b| b.error);
    (status, error)
}

fn post(url: &str, body: &[u8]) -> (u16, Option<String>) {
    status_and_error(
        agent()
            .post(url)
            .content_type("application/json")
            .send(body)
            .unwrap(),
    )
}

fn get(url: &str) -> (u16, Option<String>) {
    status_and_error(agent().get(url).call().unwrap())
}

#[test]
fn bad_requests_get_short_json_errors() {
    let (hub, _events) = Hub::<u32, u32>::new(HubConfig::default());
    let server = TestServer::start(&hub);
    let base = server.url();

    // Bad client ids, on every route.
    let long = "a".repeat(129);
    for bad in ["a%20b", "a$b", "a,b", "%2e%2e", long.as_str()] {
        for route in ["hello", "results"] {
            let (status, error) = post(&format!("{base}/clients/{bad}/{route}"), b"{}");
            assert_eq!(status, 400, "{bad} {route}");
            assert!(error.unwrap().contains("client id"));
        }
        let (status, _) = get(&format!("{base}/clients/{bad}/tasks"));
        assert_eq!(status, 400, "{bad} tasks");
    }
    // An empty id segment is still a (bad) client id, not an unknown route.
    assert_eq!(get(&format!("{base}/clients//tasks")).0, 400);
    let ok_long = "a".repeat(128);
    assert_eq!(
        post(&format!("{base}/clients/{ok_long}/hello"), b"{}").0,
        200
    );

    // Malformed JSON and wrong types.
    let results = format!("{base}/clients/w/results");
    for body in [
        &b"{\"id\": 1, \"result\""[..],
        b"{bad",
        b"",
        b"{\"id\":\"x\",\"result\":1}",
        b"{\"id\":1}",
        b"{\"id\":18446744073709551616,\"result\":1}",
        b"{\"id\":1,\"result\":\"no\"}",
        b"\xff\xfe",
    ] {
        let (status, error) = post(&results, body);
        assert_eq!(status, 400, "{}", String::from_utf8_lossy(body));
        assert!(error.unwrap().starts_with("malformed JSON"));
    }
    let (status, _) = post(&format!("{base}/clients/w/hello"), b"{\"a\":");
    assert_eq!(status, 400);
    // An empty hello is fine (null metadata).
    assert_eq!(post(&format!("{base}/clients/w/hello"), b"").0, 200);

    // Bad wait_ms.
    for q in ["wait_ms=abc", "wait_ms=-5", "wait_ms=", "wait_ms=1.5"] {
        let (status, error) = get(&format!("{base}/clients/w/tasks?{q}"));
        assert_eq!(status, 400, "{q}");
        assert!(error.unwrap().contains("wait_ms"));
    }

    // Unknown routes and methods.
    for path in [
        "/nope",
        "/clients/w",
        "/clients/w/other",
        "/clients/w/tasks/x",
    ] {
        assert_eq!(get(&format!("{base}{path}")).0, 404, "{path}");
    }
    assert_eq!(
        get(&format!("http://{}/clients/w/tasks", server.addr)).0,
        404
    );
    assert_eq!(get(&format!("{base}/clients/w/hello")).0, 405);
    assert_eq!(post(&format!("{base}/clients/w/tasks"), b"{}").0, 405);

    // A result for a client that never showed up.
    let (status, error) = post(
        &format!("{base}/clients/stranger/results"),
        b"{\"id\":1,\"result\":2}",
    );
    assert_eq!((status, error.as_deref()), (404, Some("unknown client")));
}

#[test]
fn oversized_bodies_get_413() {
    let (hub, _events) = Hub::<u32, serde_json::Value>::new(HubConfig::default());
    let server = TestServer::start(&hub);
    let base = server.url();
    let big = format!("{{\"id\":1,\"result\":\"{}\"}}", "x".repeat(64 * 1024));
    for route in ["results", "hello"] {
        let (status, error) = post(&format!("{base}/clients/w/{route}"), big.as_bytes());
        assert_eq!(status, 413, "{route}");
        assert!(error.unwrap().contains("larger than"));
    }
    // Chunked, so no Content-Length to refuse early: the read limit catches it.
    let chunk = vec![b' '; 70 * 1024];
    let mut req = format!(
        "POST {PREFIX}/clients/w/hello HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\
         Transfer-Encoding: chunked\r\n\r\n{:x}\r\n",
        chunk.len()
    )
    .into_bytes();
    req.extend_from_slice(&chunk);
    req.extend_from_slice(b"\r\n0\r\n\r\n");
    assert_eq!(raw_status(server.addr, &req), Some(413));
    // Just under the limit is served.
    let fits = format!("{{\"pad\":\"{}\"}}", "x".repeat(60 * 1024));
    assert_eq!(
        post(&format!("{base}/clients/w/hello"), fits.as_bytes()).0,
        200
    );
}

#[test]
fn the_auth_hook_guards_every_route() {
    let config = HubConfig::default()
        .with_auth(|id, token| token == Some("s3cret") && id.as_str() != "banned");
    let (hub, _events) = Hub::<u32, u32>::new(config);
    let server = TestServer::start(&hub);
    let base = server.url();

    let with = |url: &str, token: Option<&str>| {
        let mut req = agent().get(url);
        if let Some(token) = token {
            req = req.header("authorization", format!("Bearer {token}"));
        }
        req.call().unwrap()
    };
    let tasks = format!("{base}/clients/w/tasks");
    for token in [None, Some("wrong"), Some("")] {
        let resp = with(&tasks, token);
        assert_eq!(resp.status().as_u16(), 401, "{token:?}");
        assert_eq!(
            resp.headers()
                .get("www-authenticate")
                .and_then(|v| v.to_str().ok()),
            Some("Bearer")
        );
    }
    assert_eq!(with(&tasks, Some("s3cret")).status().as_u16(), 204);
    assert_eq!(
        with(&format!("{base}/clients/banned/tasks"), Some("s3cret"))
            .status()
            .as_u16(),
        401
    );
    // Auth is checked before the body is read.
    let (status, _) = post(&format!("{base}/clients/w/results"), b"{bad");
    assert_eq!(status, 401);

    // Through the client.
    let denied = Client::new(
        &base,
        "w",
        ClientOptions {
            token: Some("wrong".into()),
            ..fast_options()
        },
    )
    .unwrap();
    let err = denied.hello(&json!(null)).unwrap_err();
    assert!(
        matches!(err, ChannelError::Status { status: 401, .. }),
        "{err}"
    );
    assert!(!err.is_retryable());
    assert_eq!(
        denied
            .poll_wait::<u32>(std::time::Duration::ZERO)
            .unwrap_err()
            .status(),
        Some(401)
    );
    let allowed = Client::new(
        &base,
        "w",
        ClientOptions {
            token: Some("s3cret".into()),
            ..fast_options()
        },
    )
    .unwrap();
    allowed.hello(&json!({"ok": true})).unwrap();
}

#[test]
fn a_panicking_auth_hook_refuses_instead_of_crashing() {
    let config = HubConfig::default().with_auth(|id, _| {
        assert!(id.as_str() != "boom", "hook bug");
        true
    });
    let (hub, _events) = Hub::<u32, u32>::new(config);
    let server = TestServer::start(&hub);
    let base = server.url();
    assert_eq!(get(&format!("{base}/clients/boom/tasks")).0, 401);
    assert_eq!(get(&format!("{base}/clients/fine/tasks")).0, 204);
}
