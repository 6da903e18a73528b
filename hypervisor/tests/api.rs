//! The HTTP API on loopback: registration and its failures, the channel's
//! and admission's identity checks, operator commands, reloads, status and
//! metrics, and a fuzz of every route.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use gpushare_utils::protocol::{Command, Registered, WorkerDevice};

fn two_pods(a: &str, b: &str, extra: &str) -> String {
    format!(
        "admin_token = \"{ADMIN}\"\n{extra}\n{}{}",
        pod_toml(a, &["index = 0\nmemory = \"1g\"\ncap = 40"]),
        pod_toml(b, &["index = 0\nmemory = \"2g\"\ncap = 60"]),
    )
}

#[test]
fn registration_gives_limits_and_refuses_wrong_tokens() {
    let (a, b) = (unique("reg-a"), unique("reg-b"));
    let h = Harness::start(&two_pods(&a, &b, ""), 1, &[&a, &b]);
    let url = h.url();

    let registered = register_ok(&url, &a);
    assert_eq!(registered.pod, a);
    assert!(
        registered.worker_id.starts_with(&format!("{a}-")),
        "{registered:?}"
    );
    assert_eq!(registered.devices.len(), 1);
    let device = &registered.devices[0];
    assert_eq!(device.uuid, gpu(0));
    assert_eq!((device.memory_bytes, device.share_percent), (1 << 30, 40));
    // Unique ids.
    assert_ne!(register_ok(&url, &a).worker_id, registered.worker_id);

    for (pod, token, want) in [
        (a.as_str(), "wrong", 401),
        (a.as_str(), token_of(&b).as_str(), 401),
        ("no-such-pod", token_of(&a).as_str(), 401),
        ("bad pod/id", token_of(&a).as_str(), 401),
    ] {
        let (status, body) = register(&url, pod, token, 1);
        assert_eq!(status, want, "{pod} {token}: {body}");
        assert!(body.contains("\"error\""), "{body}");
    }
    let workers = format!("{url}/api/v1/workers");
    assert_eq!(call("POST", &workers, None, Some("{}")).0, 401);
    assert_eq!(
        call("POST", &workers, Some(&token_of(&a)), Some("{")).0,
        400
    );
    assert_eq!(
        call("POST", &workers, Some(&token_of(&a)), Some("{\"pod\":1}")).0,
        400
    );
    assert_eq!(call("GET", &workers, Some(&token_of(&a)), None).0, 405);
}

#[test]
fn a_pod_cannot_use_another_pods_worker() {
    let (a, b) = (unique("id-a"), unique("id-b"));
    let h = Harness::start(&two_pods(&a, &b, ""), 1, &[&a, &b]);
    let url = h.url();
    let wa = register_ok(&url, &a).worker_id;
    let wb = register_ok(&url, &b).worker_id;
    let poll = |worker: &str, token: &str| {
        call(
            "GET",
            &format!("{url}/api/v1/channel/clients/{worker}/tasks?wait_ms=0"),
            Some(token),
            None,
        )
        .0
    };
    // Its own commands: the Health queued at registration.
    assert_eq!(poll(&wa, &token_of(&a)), 200);
    assert_eq!(poll(&wa, &token_of(&b)), 401, "b reads a's commands");
    assert_eq!(poll(&wb, &token_of(&a)), 401);
    assert_eq!(poll("not-a-worker", &token_of(&a)), 401);
    assert_eq!(poll(&wa, "nonsense"), 401);
    let result = format!("{url}/api/v1/channel/clients/{wa}/results");
    assert_eq!(
        call(
            "POST",
            &result,
            Some(&token_of(&b)),
            Some("{\"id\":1,\"result\":{\"ok\":true}}")
        )
        .0,
        401,
        "b posts in a's name"
    );

    let admission = |worker: &str, token: &str, uuid: &str| {
        let body = format!("{{\"worker_id\":\"{worker}\",\"uuid\":\"{uuid}\",\"cost_ns\":1000}}");
        call(
            "POST",
            &format!("{url}/api/v1/admission"),
            Some(token),
            Some(&body),
        )
    };
    let (status, body) = admission(&wa, &token_of(&a), &gpu(0));
    assert_eq!(status, 200, "{body}");
    assert!(body.contains("granted_ns"), "{body}");
    assert_eq!(
        admission(&wb, &token_of(&a), &gpu(0)).0,
        401,
        "a asks in b's name"
    );
    assert_eq!(admission(&wa, &token_of(&b), &gpu(0)).0, 401);
    assert_eq!(admission(&wa, &token_of(&a), &gpu(5)).0, 404);
    // A well-formed id of b's with a's token is not adopted either.
    let forged = format!("{b}-1-1");
    assert_eq!(admission(&forged, &token_of(&a), &gpu(0)).0, 401);
}

#[test]
fn suspend_resume_and_live_limits_reach_region_and_worker() {
    let (a, b) = (unique("cmd-a"), unique("cmd-b"));
    let h = Harness::start(&two_pods(&a, &b, ""), 1, &[&a, &b]);
    let url = h.url();
    let registered = register_ok(&url, &a);
    let worker = FakeWorker::start(&url, &a, &registered.worker_id);
    let region = RegionView::open(&a);
    assert_eq!(region.limits(0).managed.load(Ordering::Acquire), 1);

    let pods = format!("{url}/api/v1/pods/{a}");
    // The admin API wants the admin token.
    assert_eq!(call("POST", &format!("{pods}/suspend"), None, None).0, 401);
    assert_eq!(
        call(
            "POST",
            &format!("{pods}/suspend"),
            Some(&token_of(&a)),
            None
        )
        .0,
        401
    );
    assert_eq!(
        call(
            "POST",
            &format!("{url}/api/v1/pods/nope/suspend"),
            Some(ADMIN),
            None
        )
        .0,
        404
    );

    let (status, body) = call("POST", &format!("{pods}/suspend"), Some(ADMIN), None);
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&registered.worker_id), "{body}");
    assert_eq!(region.limits(0).suspended.load(Ordering::Acquire), 1);
    assert_eq!(
        worker.next_command(Duration::from_secs(5)),
        Some(Command::Suspend)
    );
    // An admission request of a suspended pod gets no budget.
    let ask = format!(
        "{{\"worker_id\":\"{}\",\"uuid\":\"{}\",\"cost_ns\":1}}",
        registered.worker_id,
        gpu(0)
    );
    let (status, body) = call(
        "POST",
        &format!("{url}/api/v1/admission"),
        Some(&token_of(&a)),
        Some(&ask),
    );
    assert_eq!((status, body.as_str()), (200, "{\"granted_ns\":0}"));

    let (status, _) = call("POST", &format!("{pods}/resume"), Some(ADMIN), None);
    assert_eq!(status, 200);
    assert_eq!(region.limits(0).suspended.load(Ordering::Acquire), 0);
    assert_eq!(
        worker.next_command(Duration::from_secs(5)),
        Some(Command::Resume)
    );

    // Live limits.
    let limits = format!("{pods}/limits");
    let (status, body) = call(
        "PUT",
        &limits,
        Some(ADMIN),
        Some(r#"{"gpus":[{"index":0,"memory":"3g","cap":20,"weight":2}]}"#),
    );
    assert_eq!(status, 200, "{body}");
    assert_eq!(region.quota(0), 3 << 30);
    assert_eq!(region.rate(0), 200_000);
    match worker.next_command(Duration::from_secs(5)) {
        Some(Command::SetLimits { devices }) => {
            assert_eq!(devices.len(), 1);
            assert_eq!(
                (
                    devices[0].memory_bytes,
                    devices[0].share_percent,
                    devices[0].weight
                ),
                (3 << 30, 20, 2)
            );
        }
        other => panic!("expected SetLimits, got {other:?}"),
    }
    for bad in [
        r#"{"gpus":[{"index":0,"cap":0}]}"#,
        r#"{"gpus":[{"cap":20}]}"#,
        r#"{"gpus":[{"index":0,"memory":"lots"}]}"#,
        r#"{"gpus":[{"index":0,"colour":1}]}"#,
        r#"{"gpus":[{"index":0},{"index":0}]}"#,
        r#"[]"#,
    ] {
        let (status, body) = call("PUT", &limits, Some(ADMIN), Some(bad));
        assert_eq!(status, 400, "{bad}: {body}");
    }
    // The worker's answers are recorded.
    assert!(wait_for(Duration::from_secs(5), || {
        h.hv.hypervisor()
            .status()
            .workers
            .iter()
            .any(|w| w.id == registered.worker_id && w.last_ok == Some(true))
    }));
    let (status, body) = call("POST", &format!("{pods}/health"), Some(ADMIN), None);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn the_admin_api_is_off_without_an_admin_token() {
    let a = unique("noadmin");
    let h = Harness::start(&pod_toml(&a, &["index = 0\ncap = 50"]), 1, &[&a]);
    let (status, body) = call(
        "POST",
        &format!("{}/api/v1/pods/{a}/suspend", h.url()),
        Some("anything"),
        None,
    );
    assert_eq!(status, 403, "{body}");
}

#[test]
fn config_reload_applies_new_limits_new_pods_and_removals() {
    let (a, b, c) = (unique("rl-a"), unique("rl-b"), unique("rl-c"));
    let h = Harness::start(&two_pods(&a, &b, ""), 1, &[&a, &b, &c]);
    let url = h.url();
    let registered = register_ok(&url, &a);
    let worker = FakeWorker::start(&url, &a, &registered.worker_id);
    let wb = register_ok(&url, &b).worker_id;
    let region = RegionView::open(&a);
    assert_eq!(region.quota(0), 1 << 30);

    h.config.rewrite(&format!(
        "admin_token = \"{ADMIN}\"\n{}{}",
        pod_toml(&a, &["index = 0\nmemory = \"5g\"\ncap = 25"]),
        pod_toml(&c, &["index = 0\nmemory = \"1g\""]),
    ));
    assert!(
        wait_for(Duration::from_secs(5), || region.quota(0) == 5 << 30),
        "new quota not applied"
    );
    assert_eq!(region.rate(0), 250_000);
    match worker.next_command(Duration::from_secs(5)) {
        Some(Command::SetLimits { devices }) => assert_eq!(devices[0].memory_bytes, 5 << 30),
        other => panic!("expected SetLimits, got {other:?}"),
    }
    let status = h.hv.hypervisor().status();
    let ids: Vec<&str> = status.pods.iter().map(|p| p.id.as_str()).collect();
    assert!(
        ids.contains(&a.as_str()) && ids.contains(&c.as_str()),
        "{ids:?}"
    );
    assert!(!ids.contains(&b.as_str()), "{ids:?}");
    // b's worker is gone with its pod.
    assert!(!status.workers.iter().any(|w| w.id == wb));
    assert_eq!(register(&url, &b, &token_of(&b), 1).0, 401);
    assert!(std::path::Path::new(&format!("/dev/shm/gpushare-pod-{c}")).exists());

    // A broken file changes nothing; the admin reload reports why.
    h.config.rewrite("[[pods]]\nid = \"x\"\n");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(region.quota(0), 5 << 30);
    let (status, body) = call("POST", &format!("{url}/api/v1/reload"), Some(ADMIN), None);
    // The broken file has no admin token any more, but the old one holds.
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("token"), "{body}");
}

#[test]
fn a_registration_cannot_move_a_quota() {
    let a = unique("ord");
    let h = Harness::start(
        &pod_toml(&a, &["index = 1\nmemory = \"1g\"\ncap = 30"]),
        2,
        &[&a],
    );
    let region = RegionView::open(&a);
    assert_eq!(region.quota(1), 1 << 30);
    // Two containers of the pod: one sees GPU 1 as its device 0, the other
    // claims GPU 0 is its device 0. Neither moves the quota off GPU 1.
    for uuid in [gpu(1), gpu(0)] {
        register_with_devices(&h.url(), &a, vec![WorkerDevice { index: 0, uuid }]);
    }
    assert_eq!(region.quota(1), 1 << 30);
    assert_eq!(region.rate(1), 300_000);
    assert_eq!(region.quota(0), 0, "GPU 0 is not the pod's");
    assert_eq!(region.rate(0), 0);
    // More devices than a process can see are refused.
    let many: Vec<WorkerDevice> = (0..17)
        .map(|index| WorkerDevice {
            index,
            uuid: gpu(index),
        })
        .collect();
    let body = serde_json::to_string(&gpushare_utils::protocol::Register {
        pod: a.clone(),
        pid: std::process::id(),
        hostname: String::new(),
        devices: many,
    })
    .expect("encode");
    let (status, text) = call(
        "POST",
        &format!("{}/api/v1/workers", h.url()),
        Some(&token_of(&a)),
        Some(&body),
    );
    assert_eq!(status, 400, "{text}");
}

#[test]
fn regions_are_created_private_and_limits_read_only() {
    let (a, b) = (unique("perm-a"), unique("perm-b"));
    let h = Harness::start(
        &format!(
            "region_mode = \"0640\"\n{}",
            pod_toml(&a, &["index = 0\ncap = 50"])
        ),
        1,
        &[&a, &b],
    );
    let mode = |name: String| {
        std::fs::symlink_metadata(format!("/dev/shm/{name}"))
            .expect("region file")
            .permissions()
            .mode()
            & 0o777
    };
    assert_eq!(mode(format!("gpushare-pod-{a}")), 0o640);
    assert_eq!(mode(format!("gpushare-limits-{a}")), 0o644);
    // A region someone else left group- or world-writable is refused, not
    // adopted: the pod is left out until it is fixed.
    let squatted = format!("/dev/shm/gpushare-pod-{b}");
    std::fs::write(&squatted, vec![0u8; 4096]).expect("plant a region");
    std::fs::set_permissions(&squatted, std::fs::Permissions::from_mode(0o666)).expect("chmod");
    h.config.rewrite(&format!(
        "{}{}",
        pod_toml(&a, &["index = 0\ncap = 50"]),
        pod_toml(&b, &["index = 0\ncap = 50"])
    ));
    assert!(wait_for(Duration::from_secs(5), || {
        let (_, body) = call("GET", &format!("{}/api/v1/status", h.url()), None, None);
        body.contains(&a) && !body.contains(&format!("\"{b}\""))
    }));
    assert!(
        !std::path::Path::new(&format!("/dev/shm/gpushare-limits-{b}")).exists(),
        "no limits published for a pod whose region is refused"
    );
}

#[test]
fn status_and_metrics_show_pods_gpus_and_latency() {
    let (a, b) = (unique("met-a"), unique("met-b"));
    let h = Harness::start(&two_pods(&a, &b, ""), 1, &[&a, &b]);
    let url = h.url();
    let w = register_ok(&url, &a).worker_id;
    h.sim.set_processes(
        0,
        vec![hypervisor::observer::ProcessUtilization {
            pid: std::process::id(),
            sm_percent: 42,
            memory_percent: 1,
        }],
    );
    // Maintenance (every second) looks at the GPUs.
    assert!(wait_for(Duration::from_secs(3), || !h
        .hv
        .hypervisor()
        .status()
        .processes
        .is_empty()));
    let ask = format!(
        "{{\"worker_id\":\"{w}\",\"uuid\":\"{}\",\"cost_ns\":1}}",
        gpu(0)
    );
    for _ in 0..5 {
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
    }
    let (status, text) = call("GET", &format!("{url}/metrics"), None, None);
    assert_eq!(status, 200);
    for want in [
        format!(
            "gpushare_pod_memory_quota_bytes{{pod=\"{a}\",gpu=\"{}\"}} 1073741824",
            gpu(0)
        ),
        format!("gpushare_pod_workers{{pod=\"{a}\"}} 1"),
        "gpushare_pod_share_granted_ratio".to_owned(),
        "gpushare_pod_share_achieved_ratio".to_owned(),
        "gpushare_pod_waiting_launches".to_owned(),
        "gpushare_gpu_memory_total_bytes".to_owned(),
        "gpushare_admission_latency_seconds_bucket{le=\"+Inf\"} 5".to_owned(),
        "gpushare_admission_latency_seconds_count 5".to_owned(),
        format!(
            "gpushare_process_sm_utilization_ratio{{gpu=\"{}\",pid=\"{}\",pod=\"{a}\"}} 0.42",
            gpu(0),
            std::process::id()
        ),
    ] {
        assert!(text.contains(&want), "missing {want} in\n{text}");
    }
    let (status, json) = call("GET", &format!("{url}/api/v1/status"), None, None);
    assert_eq!(status, 200);
    let parsed: hypervisor::status::Status = serde_json::from_str(&json).expect("status JSON");
    assert_eq!(parsed.pods.len(), 2);
    assert_eq!(parsed.admission.count, 5);
    let table = hypervisor::status::render_table(&parsed);
    assert!(table.contains(&a) && table.contains("GRANTED"), "{table}");
    assert_eq!(
        call("GET", &format!("{url}/healthz"), None, None),
        (200, "ok".to_owned())
    );
    let _: Registered =
        serde_json::from_str(&register(&url, &b, &token_of(&b), 1).1).expect("b registers");
}

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
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    drop(hung);
}

#[test]
fn usage_a_pod_does_not_report_is_caught_against_nvml() {
    let a = unique("audit");
    let h = Harness::start(&pod_toml(&a, &["index = 0\nmemory = \"4g\""]), 1, &[&a]);
    // This process is one of the pod's (it holds a ledger slot) and reports
    // nothing, while NVML says it holds 2 GiB on the GPU.
    let region = RegionView::open(&a);
    h.sim.set_process_memory(
        0,
        vec![hypervisor::observer::ProcessMemory {
            pid: std::process::id(),
            bytes: 2 << 30,
        }],
    );
    let gpu_status = || h.first_gpu_status(&a);
    assert!(
        wait_for(Duration::from_secs(5), || gpu_status().memory_nvml
            == Some(2 << 30)),
        "{:?}",
        gpu_status()
    );
    let seen = gpu_status();
    assert_eq!(seen.memory_used, 0);
    assert!(seen.memory_under_reported, "{seen:?}");
    let (_, metrics) = call("GET", &format!("{}/metrics", h.url()), None, None);
    assert!(
        metrics.contains("gpushare_pod_memory_nvml_bytes{") && metrics.contains(" 2147483648"),
        "{metrics}"
    );
    // Reported now: no longer flagged.
    region
        .0
        .try_reserve(region.entry(0), 2 << 30)
        .expect("reserve");
    assert!(wait_for(Duration::from_secs(5), || !gpu_status()
        .memory_under_reported));
}
