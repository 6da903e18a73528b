//! A seeded fuzz of the routes over raw TCP on loopback: generated paths,
//! queries, methods and bodies. Every answer must be 2xx or 4xx, never 5xx,
//! never silence; the server must still serve afterwards. Bounded in count
//! and time.

use crate::common;

use std::time::{Duration, Instant};

use common::{PREFIX, TestServer, raw_status};
use http_bidir_comm::{ClientId, Hub, HubConfig};
use serde_json::Value;
use system_tests::fuzz::Rng;

const REQUESTS: usize = 3000;
const TIME_LIMIT: Duration = Duration::from_secs(30);

fn client_id(rng: &mut Rng) -> String {
    match rng.below(8) {
        0..=3 => format!("c{}", rng.below(20)),
        4 => "a".repeat(1 + rng.below(200)),
        5 => {
            // Printable ASCII, no space: may or may not be a valid id.
            (0..1 + rng.below(20))
                .map(|_| (0x21 + rng.below(0x5e) as u8) as char)
                .filter(|c| !matches!(c, '/' | '?' | '#'))
                .collect()
        }
        6 => rng.bytes(10).iter().map(|b| format!("%{b:02X}")).collect(),
        _ => rng
            .pick(&["..", ".", "%2e%2e", "-", "a:b.c_d-e", ""])
            .to_string(),
    }
}

fn path(rng: &mut Rng) -> String {
    let id = client_id(rng);
    let route = *rng.pick(&["tasks", "results", "hello", "hello/", "x", "", "tasks/1"]);
    let query = match rng.below(8) {
        0 => String::new(),
        1 => format!("?wait_ms={}", rng.below(6)),
        2 => "?wait_ms=99999999999999999999999999".to_owned(),
        3 => "?wait_ms=-1".to_owned(),
        4 => format!("?wait_ms={}&wait_ms=x", rng.below(3)),
        5 => format!(
            "?{}",
            String::from_utf8_lossy(&rng.bytes(8))
                .replace(|c: char| !c.is_ascii_graphic() || c == '#', "")
        ),
        6 => "?wait_ms=1e9".to_owned(),
        _ => "?wait_ms=0".to_owned(),
    };
    match rng.below(20) {
        0 => format!("/{}", rng.below(1000)),
        1 => format!("{PREFIX}/clients"),
        2 => format!("{PREFIX}/clients/{id}"),
        _ => format!("{PREFIX}/clients/{id}/{route}{query}"),
    }
}

fn nested(depth: usize, open: &str, close: &str) -> String {
    format!("{}{}", open.repeat(depth), close.repeat(depth))
}

fn body(rng: &mut Rng, delivered: &[u64]) -> Vec<u8> {
    let valid_result = |id: u64| format!("{{\"id\":{id},\"result\":{{\"ok\":true}}}}");
    match rng.below(12) {
        0 => rng.bytes(2000),
        1 => {
            let full = valid_result(rng.number() % 100);
            full.as_bytes()[..rng.below(full.len())].to_vec()
        }
        2 => rng
            .pick(&[
                "{\"id\":\"1\",\"result\":1}",
                "{\"id\":-1,\"result\":1}",
                "{\"id\":1.5,\"result\":1}",
                "{\"id\":null,\"result\":1}",
                "{\"result\":1}",
                "{\"id\":1}",
                "[]",
                "null",
                "1",
                "\"str\"",
                "{\"id\":[1],\"result\":{}}",
                "{\"id\":1,\"result\":1,\"id\":2}",
            ])
            .as_bytes()
            .to_vec(),
        3 => rng
            .pick(&[
                "{\"id\":18446744073709551616,\"result\":1}",
                "{\"id\":1e400,\"result\":1}",
                "{\"id\":1,\"result\":1e99999}",
                "{\"id\":1,\"result\":-1e-99999}",
                "{\"id\":99999999999999999999999999999999999999,\"result\":0}",
            ])
            .as_bytes()
            .to_vec(),
        4 => {
            let depth = 1 + rng.below(20_000);
            let inner = if rng.chance(50) {
                nested(depth, "[", "]")
            } else {
                nested(depth, "{\"a\":", "}")
            };
            format!("{{\"id\":1,\"result\":{inner}}}").into_bytes()
        }
        5 => nested(1 + rng.below(5000), "[", "]").into_bytes(),
        6 => vec![b'x'; 64 * 1024 + 1 + rng.below(10_000)],
        7 => b"{\"id\":1,\"result\":\"\xff\xfe\"}".to_vec(),
        8 if !delivered.is_empty() => valid_result(*rng.pick(delivered)).into_bytes(),
        9 => b"{\"meta\":{\"pid\":1,\"gpu\":[0,1]}}".to_vec(),
        10 => Vec::new(),
        _ => valid_result(rng.number() % 50).into_bytes(),
    }
}

fn request(method: &str, path: &str, body: &[u8], chunked: bool) -> Vec<u8> {
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n");
    if chunked {
        req.push_str("Transfer-Encoding: chunked\r\n\r\n");
        let mut out = req.into_bytes();
        for chunk in body.chunks(1000) {
            out.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
            out.extend_from_slice(chunk);
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"0\r\n\r\n");
        out
    } else {
        req.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        ));
        let mut out = req.into_bytes();
        out.extend_from_slice(body);
        out
    }
}

#[test]
fn generated_requests_never_get_a_5xx() {
    let config = HubConfig {
        max_wait: Duration::from_millis(5),
        ..HubConfig::default()
    };
    let (hub, mut events) = Hub::<Value, Value>::new(config);
    let server = TestServer::start(&hub);
    let mut rng = Rng::new(0x5EED_1234_ABCD_0001);

    let mut counts = std::collections::BTreeMap::<u16, usize>::new();
    let started = Instant::now();
    let mut sent = 0;
    while sent < REQUESTS && started.elapsed() < TIME_LIMIT {
        // Keep real work in flight so that some results are valid.
        if sent % 50 == 0 {
            for c in 0..20 {
                let id = ClientId::new(format!("c{c}")).unwrap();
                hub.submit(&id, serde_json::json!({"n": sent})).unwrap();
            }
        }
        while events.try_recv().is_ok() {}
        let delivered: Vec<u64> = (1..=(sent as u64 / 50 + 1) * 20).collect();

        let method = *rng.pick(&[
            "GET", "GET", "POST", "POST", "POST", "PUT", "DELETE", "HEAD",
        ]);
        let path = path(&mut rng);
        let body = body(&mut rng, &delivered);
        let chunked = rng.chance(15);
        let req = request(method, &path, &body, chunked);
        let status = raw_status(server.addr, &req);
        let Some(status) = status else {
            panic!(
                "no answer to request {sent}: {method} {path} ({} body bytes)",
                body.len()
            );
        };
        assert!(
            (200..500).contains(&status),
            "request {sent}: {method} {path} body {:?} → {status}",
            String::from_utf8_lossy(&body[..body.len().min(200)])
        );
        *counts.entry(status).or_default() += 1;
        sent += 1;
    }
    eprintln!(
        "fuzz: {sent} requests in {:?}, statuses {counts:?}",
        started.elapsed()
    );
    assert!(sent >= 1000, "only {sent} requests in the time limit");
    // Both outcomes were exercised.
    assert!(counts.keys().any(|s| (200..300).contains(s)));
    assert!(counts.contains_key(&400) && counts.contains_key(&404) && counts.contains_key(&413));

    // Still serving.
    let hello = format!("{PREFIX}/clients/after-fuzz/hello");
    assert_eq!(
        raw_status(server.addr, &request("POST", &hello, b"{}", false)),
        Some(200)
    );
}
