//! The HTTP API on loopback, identity: registration and its failures, and
//! the channel's and admission's checks that a pod speaks only for its own
//! workers and GPUs.

use crate::common;

use common::*;
use gpushare_utils::protocol::WorkerDevice;

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
        fast_swap: false,
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
