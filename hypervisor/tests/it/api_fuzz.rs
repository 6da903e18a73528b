//! The HTTP API on loopback under abuse: a fuzz of every route of the
//! daemon's route table ([`ROUTES`]), with the method it takes and others,
//! checked against what the router serves and who may call it; and clients
//! that hang.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::*;
use hypervisor_daemon::api::{ApiRoute, Caller, ROUTES};
use serde_json::{Value, json};
use system_tests::fuzz::Rng;
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

/// The methods a request is sent with.
const METHODS: [&str; 6] = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"];

/// `method path` sent raw to `addr` with the header lines `auth` and
/// `body`: the status and the body of the answer; `None` for a body over
/// the limit refused before it was read (the connection reset, no answer).
fn send(
    addr: std::net::SocketAddr,
    method: &str,
    path: &str,
    auth: &str,
    body: &str,
) -> Option<(u16, String)> {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: hv\r\nConnection: close\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("timeout");
    let sent = std::io::Write::write_all(&mut stream, request.as_bytes());
    let mut response = Vec::new();
    let read = std::io::Read::read_to_end(&mut stream, &mut response);
    if body.len() > 64 * 1024 && response.is_empty() {
        return None;
    }
    sent.expect("send");
    if response.is_empty() {
        read.expect("read");
    }
    let text = String::from_utf8_lossy(&response);
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status for {method} {path}: {text:?}"));
    let body = text.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    Some((status, body.to_owned()))
}

/// Whether the router itself refused the request: no route for the path
/// (404 "not found", which no handler says) or not for the method (405).
fn router_refused(status: u16, body: &str) -> bool {
    status == 405 || (status == 404 && body.contains("\"not found\""))
}

/// `header: Bearer token` line, or nothing.
fn bearer(token: Option<&str>) -> String {
    token.map_or_else(String::new, |t| format!("Authorization: Bearer {t}\r\n"))
}

/// `route`'s path with each `{name}` parameter given by `value(name)`.
fn fill(route: &ApiRoute, mut value: impl FnMut(&str) -> String) -> String {
    let mut path = String::new();
    for segment in route.path.split('/').skip(1) {
        path.push('/');
        match segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
            Some(name) => path.push_str(&value(name)),
            None => path.push_str(segment),
        }
    }
    path
}

#[test]
fn fuzzed_requests_never_get_a_server_error() {
    let (a, b) = (unique("fz-a"), unique("fz-b"));
    // Swaps and moves through the driver double's checkpoint API: the pods
    // have no processes, so each is done at once.
    let library = gpushare_examples::double_dir().join("libcuda.so.1");
    let swap = format!("[swap]\ncuda_library = \"{}\"", library.display());
    let h = Harness::start(&two_pods(&a, &b, &swap), 2, &[&a, &b]);
    let url = h.url();
    let wa = register_ok(&url, &a).worker_id;
    let wb = register_ok(&url, &b).worker_id;
    let (ta, tb) = (token_of(&a), token_of(&b));
    // A body for each route that takes one, mutated by the fuzz.
    let templates: BTreeMap<&str, Value> = BTreeMap::from([
        (
            "/api/v1/workers",
            json!({"pod": a, "pid": 7, "hostname": "h", "devices": [{"index": 0, "uuid": gpu(0)}]}),
        ),
        (
            "/api/v1/admission",
            json!({"worker_id": wa, "uuid": gpu(0), "cost_ns": 1000}),
        ),
        (
            "/api/v1/pods/{id}/limits",
            json!({"gpus": [{"index": 0, "memory": "1g", "cap": 50, "weight": 2, "share": 10, "policy": "elastic"}]}),
        ),
        (
            "/api/v1/channel/clients/{worker}/results",
            json!({"id": 1, "result": {"ok": true, "message": "m"}}),
        ),
        ("/api/v1/channel/clients/{worker}/hello", json!({"pid": 1})),
        ("/api/v1/pods/{id}/move", json!({"to": 1, "from": 0})),
        ("/api/v1/swap-in", json!({"worker_id": wa})),
        (
            "/api/v1/room",
            json!({"worker_id": wa, "uuid": gpu(0), "bytes": 1 << 20}),
        ),
    ]);
    for path in templates.keys() {
        assert!(
            ROUTES.iter().any(|r| r.path == *path),
            "a body for {path}, which the route table does not list"
        );
    }
    let values = |name: &str| -> Vec<String> {
        let values: &[&str] = match name {
            "id" => &[&a, &b, "nope", "%2F", "..", "a%20b", "x-1-2"],
            "worker" => &[&wa, &wb, "unknown", "x-1-2", "%2Fetc", ".."],
            "gpu" => &["0", "1", "9", &gpu(1), "GPU-nope", "%2F"],
            other => panic!("no fuzz values for the path parameter {{{other}}}: add some"),
        };
        values.iter().map(|v| (*v).to_owned()).collect()
    };
    for route in ROUTES {
        let (method, path) = (route.method.as_str(), fill(route, |n| values(n).remove(0)));
        let body = templates
            .get(route.path)
            .map_or(String::new(), Value::to_string);
        let token = match route.caller {
            Caller::Pod => Some(ta.as_str()),
            Caller::Admin => Some(ADMIN),
            Caller::Listener | Caller::Anyone => None,
        };
        // The router serves the table's method, and no other.
        let (status, answer) = send(h.addr(), method, &path, &bearer(token), &body).unwrap();
        assert!(
            !router_refused(status, &answer),
            "{method} {} is in the route table but not served: {status} {answer}",
            route.path
        );
        let others = METHODS.iter().filter(|m| {
            !ROUTES
                .iter()
                .any(|r| r.path == route.path && r.method.as_str() == **m)
        });
        for other in others {
            let (status, answer) = send(h.addr(), other, &path, &bearer(token), &body).unwrap();
            assert_eq!(
                status, 405,
                "{other} {}, which the route table does not list: {answer}",
                route.path
            );
        }
        // Who may call it: the table's caller, and no one less.
        let (status, answer) = send(h.addr(), method, &path, "", &body).unwrap();
        let open = matches!(route.caller, Caller::Listener | Caller::Anyone);
        assert_eq!(
            status == 401,
            !open,
            "{method} {} without a token ({:?}): {status} {answer}",
            route.path,
            route.caller
        );
        if route.caller == Caller::Admin {
            let (status, answer) = send(h.addr(), method, &path, &bearer(Some(&ta)), "").unwrap();
            assert_eq!(
                status, 401,
                "{method} {} with a pod's token: {answer}",
                route.path
            );
        }
    }
    let junk_paths = [
        "/api/v1/nothing",
        "/api/v1/pods//limits",
        "/",
        "/api/v1/workers/../status",
        "/%2e%2e/%00",
    ];
    let queries = ["", "?wait_ms=0", "?wait_ms=-1", "?wait_ms=2", "?x=%00"];
    let tokens = [ta.as_str(), tb.as_str(), ADMIN, "garbage"];
    let mut rng = Rng::new(0x5eed_1234_abcd_0001);
    let mut counts = BTreeMap::new();
    let mut exercised = vec![0usize; ROUTES.len()];
    let started = std::time::Instant::now();
    const REQUESTS: usize = 3000;
    for n in 0..REQUESTS {
        let (method, path, body) = if rng.below(6) == 0 {
            let method = *rng.pick(&METHODS);
            (method, (*rng.pick(&junk_paths)).to_owned(), String::new())
        } else {
            let at = rng.below(ROUTES.len());
            let route = &ROUTES[at];
            let method = if rng.below(5) == 0 {
                *rng.pick(&METHODS)
            } else {
                route.method.as_str()
            };
            if method == route.method.as_str() {
                exercised[at] += 1;
            }
            let path = fill(route, |name| {
                let values = values(name);
                values[rng.below(values.len())].clone()
            }) + *rng.pick(&queries);
            let template = templates.get(route.path);
            let body = match (rng.below(6), template) {
                (0, _) => (0..rng.below(200))
                    .map(|_| (rng.number() & 0x7f) as u8 as char)
                    .collect(),
                (1, _) => "[".repeat(rng.below(300)),
                (2, _) | (_, None) => String::new(),
                (3, Some(template)) => template.to_string(),
                (_, Some(template)) => {
                    let mut v = template.clone();
                    for _ in 0..=rng.below(3) {
                        v = mutate_json(&mut rng, &v);
                    }
                    v.to_string()
                }
            };
            (method, path, body)
        };
        let auth = match rng.below(6) {
            0 => String::new(),
            1 => "Authorization: Basic abc\r\n".to_owned(),
            n => bearer(Some(tokens[n % tokens.len()])),
        };
        // Now and then a body over the limit.
        let body = if n % 500 == 7 {
            "x".repeat(70 * 1024)
        } else {
            body
        };
        let Some((status, answer)) = send(h.addr(), method, &path, &auth, &body) else {
            // Refused before the body was read, then reset.
            *counts.entry(0).or_insert(0usize) += 1;
            continue;
        };
        assert!(
            (200..500).contains(&status),
            "{method} {path} {body:?} → {status}: {answer}"
        );
        *counts.entry(status).or_insert(0usize) += 1;
    }
    println!(
        "fuzz: {REQUESTS} requests in {:?}, statuses {counts:?}",
        started.elapsed()
    );
    let missed: Vec<String> = ROUTES
        .iter()
        .zip(&exercised)
        .filter(|(_, n)| **n == 0)
        .map(|(r, _)| format!("{} {}", r.method, r.path))
        .collect();
    assert!(missed.is_empty(), "routes the fuzz never sent: {missed:?}");
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
