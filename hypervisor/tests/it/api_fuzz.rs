//! The HTTP API on loopback under abuse: a fuzz of every route, and clients
//! that hang.

use crate::common;

use std::time::Duration;

use common::*;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

fn mutate_json(rng: &mut Rng, value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    let replacement = |rng: &mut Rng| match rng.below(10) {
        0 => Value::Null,
        1 => Value::Bool(rng.below(2) == 0),
        2 => Value::from(-1),
        3 => Value::from(u64::MAX),
        4 => Value::from(1e300),
        5 => Value::from("GPU-00000000-0000-4000-8000-000000000000"),
        6 => Value::from("x".repeat(rng.below(300))),
        7 => Value::Array(vec![Value::from(1), Value::Null]),
        8 => serde_json::json!({"nested": {"deeper": []}}),
        _ => Value::from(rng.below(1000) as u64),
    };
    match value {
        Value::Object(map) => {
            let mut out = map.clone();
            let keys: Vec<String> = out.keys().cloned().collect();
            if !keys.is_empty() {
                let key = &keys[rng.below(keys.len())];
                match rng.below(4) {
                    0 => {
                        out.remove(key);
                    }
                    1 => {
                        out.insert(key.clone(), replacement(rng));
                    }
                    2 => {
                        let inner = out[key].clone();
                        out.insert(key.clone(), mutate_json(rng, &inner));
                    }
                    _ => {
                        out.insert(format!("extra{}", rng.below(9)), replacement(rng));
                    }
                }
            }
            Value::Object(out)
        }
        Value::Array(items) if !items.is_empty() => {
            let mut out = items.clone();
            let at = rng.below(out.len());
            out[at] = mutate_json(rng, &out[at]);
            Value::Array(out)
        }
        _ => replacement(rng),
    }
}

#[test]
fn fuzzed_requests_never_get_a_server_error() {
    let (a, b) = (unique("fz-a"), unique("fz-b"));
    let h = Harness::start(&two_pods(&a, &b, ""), 2, &[&a, &b]);
    let url = h.url();
    let wa = register_ok(&url, &a).worker_id;
    let wb = register_ok(&url, &b).worker_id;
    let (ta, tb) = (token_of(&a), token_of(&b));
    let templates: Vec<(&str, serde_json::Value)> = vec![
        (
            "/api/v1/workers",
            serde_json::json!({"pod": a, "pid": 7, "hostname": "h", "devices": [{"index": 0, "uuid": gpu(0)}]}),
        ),
        (
            "/api/v1/admission",
            serde_json::json!({"worker_id": wa, "uuid": gpu(0), "cost_ns": 1000}),
        ),
        (
            "/api/v1/pods/{pod}/limits",
            serde_json::json!({"gpus": [{"index": 0, "memory": "1g", "cap": 50, "weight": 2, "share": 10, "policy": "elastic"}]}),
        ),
        (
            "/api/v1/channel/clients/{worker}/results",
            serde_json::json!({"id": 1, "result": {"ok": true, "message": "m"}}),
        ),
        (
            "/api/v1/channel/clients/{worker}/hello",
            serde_json::json!({"pid": 1}),
        ),
    ];
    let plain_paths = [
        "/api/v1/status",
        "/metrics",
        "/healthz",
        "/api/v1/reload",
        "/api/v1/pods/{pod}/suspend",
        "/api/v1/pods/{pod}/resume",
        "/api/v1/pods/{pod}/health",
        "/api/v1/channel/clients/{worker}/tasks?wait_ms=0",
        "/api/v1/channel/clients/{worker}/tasks?wait_ms=-1",
        "/api/v1/channel/clients/{worker}/tasks?wait_ms=2",
        "/api/v1/nothing",
        "/api/v1/pods//limits",
        "/",
        "/api/v1/workers/../status",
        "/%2e%2e/%00",
    ];
    let pods = [
        a.as_str(),
        b.as_str(),
        "nope",
        "%2F",
        "..",
        "a%20b",
        "x-1-2",
    ];
    let workers = [wa.as_str(), wb.as_str(), "unknown", "x-1-2", "%2Fetc", ".."];
    let tokens = [ta.as_str(), tb.as_str(), ADMIN, "garbage"];
    let methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let mut counts = std::collections::BTreeMap::new();
    let started = std::time::Instant::now();
    const REQUESTS: usize = 3000;
    for n in 0..REQUESTS {
        let (path, body) = if rng.below(3) == 0 {
            (rng.pick(&plain_paths).to_owned(), String::new())
        } else {
            let (path, template) = &templates[rng.below(templates.len())];
            let body = match rng.below(6) {
                0 => template.to_string(),
                1 => (0..rng.below(200))
                    .map(|_| (rng.next() & 0x7f) as u8 as char)
                    .collect(),
                2 => "[".repeat(rng.below(300)),
                3 => String::new(),
                _ => {
                    let mut v = template.clone();
                    for _ in 0..=rng.below(3) {
                        v = mutate_json(&mut rng, &v);
                    }
                    v.to_string()
                }
            };
            (path.to_string(), body)
        };
        let path = path
            .replace("{pod}", rng.pick(&pods))
            .replace("{worker}", rng.pick(&workers));
        let method = if rng.below(5) == 0 {
            rng.pick(&methods)
        } else if path.contains("limits") {
            "PUT"
        } else if path.contains("tasks") || path == "/metrics" || path.ends_with("status") {
            "GET"
        } else {
            "POST"
        };
        let auth = match rng.below(6) {
            0 => String::new(),
            1 => "Authorization: Basic abc\r\n".to_owned(),
            n => format!("Authorization: Bearer {}\r\n", tokens[n % tokens.len()]),
        };
        // Now and then a body over the limit.
        let body = if n % 500 == 7 {
            "x".repeat(70 * 1024)
        } else {
            body
        };
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: hv\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        let mut stream = std::net::TcpStream::connect(h.addr()).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let oversized = body.len() > 64 * 1024;
        let sent = std::io::Write::write_all(&mut stream, request.as_bytes());
        let mut response = Vec::new();
        let read = std::io::Read::read_to_end(&mut stream, &mut response);
        if oversized && response.is_empty() {
            // Refused before the body was read, then reset: no answer to read.
            *counts.entry(0).or_insert(0usize) += 1;
            continue;
        }
        sent.expect("send");
        if response.is_empty() {
            read.expect("read");
        }
        let text = String::from_utf8_lossy(&response);
        let status: u16 = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("no status for {method} {path}: {text:?}"));
        assert!(
            (200..500).contains(&status),
            "{method} {path} {body:?} → {status}: {text}"
        );
        *counts.entry(status).or_insert(0usize) += 1;
    }
    println!(
        "fuzz: {REQUESTS} requests in {:?}, statuses {counts:?}",
        started.elapsed()
    );
    // Still serving, and still right.
    assert_eq!(call("GET", &format!("{url}/healthz"), None, None).0, 200);
    let again = register_ok(&url, &a);
    assert!(again.worker_id.starts_with(&a));
}

#[test]
fn hung_clients_do_not_block_others() {
    let a = unique("hung");
    let h = Harness::start(
        &format!(
            "admin_token = \"{ADMIN}\"\n{}",
            pod_toml(&a, &["index = 0\ncap = 50"])
        ),
        1,
        &[&a],
    );
    let url = h.url();
    let stuck = register_ok(&url, &a).worker_id;
    // Half-sent requests that never finish, and long-polls nobody reads.
    let mut hung = Vec::new();
    for n in 0..40 {
        let mut s = std::net::TcpStream::connect(h.addr()).expect("connect");
        let request = if n % 2 == 0 {
            "POST /api/v1/workers HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pod\""
                .to_owned()
        } else {
            format!(
                "GET /api/v1/channel/clients/{stuck}/tasks?wait_ms=30000 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\r\n",
                token_of(&a)
            )
        };
        std::io::Write::write_all(&mut s, request.as_bytes()).expect("send");
        hung.push(s);
    }
    let start = std::time::Instant::now();
    let w = register_ok(&url, &a).worker_id;
    let ask = format!(
        "{{\"worker_id\":\"{w}\",\"uuid\":\"{}\",\"cost_ns\":1}}",
        gpu(0)
    );
    assert_eq!(
        call(
            "POST",
            &format!("{url}/api/v1/admission"),
            Some(&token_of(&a)),
            Some(&ask)
        )
        .0,
        200
    );
    // Commands to the stuck worker queue up without blocking anyone.
    for _ in 0..20 {
        assert_eq!(
            call(
                "POST",
                &format!("{url}/api/v1/pods/{a}/health"),
                Some(ADMIN),
                None
            )
            .0,
            200
        );
    }
    assert_eq!(
        call("GET", &format!("{url}/api/v1/status"), None, None).0,
        200
    );
    // Blocked behind a hung connection, a request would wait for it to end:
    // never for the half-sent bodies, 30 s for the long-polls; `call` gives
    // up after 10 s. The 23 requests above take well under a second, even on
    // a loaded machine: 5 s lies between the two.
    let took = start.elapsed();
    println!("23 requests beside 40 hung connections: {took:?}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    drop(hung);
}
