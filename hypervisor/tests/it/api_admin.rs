//! The HTTP API on loopback, the operator's side: commands, live limits,
//! config reloads, the regions' permissions, status and metrics, and the
//! audit of usage against NVML.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::*;
use gpushare_utils::protocol::{Command, Registered};

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
    // GPUs the pod's objects cannot hold, that the node does not have, or
    // one GPU twice: refused whole, and the limits in force stay.
    let many: Vec<String> = (0..40)
        .map(|n| format!(r#"{{"uuid":"GPU-{n:08x}-0000-4000-8000-000000000000","memory":"1g"}}"#))
        .collect();
    let unknown = r#"{"gpus":[{"uuid":"GPU-00000000-1111-4000-8000-000000000000","memory":"1g"}]}"#;
    let twice = format!(
        r#"{{"gpus":[{{"index":0,"memory":"1g"}},{{"uuid":"{}","memory":"2g"}}]}}"#,
        gpu(0)
    );
    for (bad, reason) in [
        (format!(r#"{{"gpus":[{}]}}"#, many.join(",")), "at most 16"),
        (unknown.to_owned(), "is not a GPU of this node"),
        (twice, "select the same GPU"),
    ] {
        let (status, body) = call("PUT", &limits, Some(ADMIN), Some(&bad));
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body.contains(reason), "{bad}: {body}");
        assert_eq!(
            region.quota(0),
            3 << 30,
            "{bad}: the limits in force changed"
        );
        assert_eq!(
            region.rate(0),
            200_000,
            "{bad}: the limits in force changed"
        );
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
    // The region's quota and rate are written one after the other.
    assert!(
        wait_for(Duration::from_secs(5), || region.quota(0) == 5 << 30
            && region.rate(0) == 250_000),
        "new limits not applied: quota {}, rate {}",
        region.quota(0),
        region.rate(0)
    );
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
    // A region someone else left group- or world-writable is not adopted:
    // it is removed and made again, and the pod served from its own.
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
        body.contains(&a) && body.contains(&format!("\"{b}\""))
    }));
    assert_eq!(
        mode(format!("gpushare-pod-{b}")) & 0o022,
        0,
        "not the planted 0666"
    );
    assert!(
        std::path::Path::new(&format!("/dev/shm/gpushare-limits-{b}")).exists(),
        "limits published for the pod"
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
        vec![hypervisor_observer::ProcessUtilization {
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
    // Budget the pod's bucket dropped at its depth, as the limiter counts it.
    RegionView::open(&a)
        .bucket(0)
        .forfeited_ns
        .store(1_500_000_000, Ordering::Relaxed);
    let (status, text) = call("GET", &format!("{url}/metrics"), None, None);
    assert_eq!(status, 200);
    for want in [
        format!(
            "gpushare_pod_memory_quota_bytes{{pod=\"{a}\",gpu=\"{}\"}} 1073741824",
            gpu(0)
        ),
        format!(
            "gpushare_pod_share_forfeited_seconds_total{{pod=\"{a}\",gpu=\"{}\"}} 1.500000",
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
    let parsed: hypervisor_status::status::Status =
        serde_json::from_str(&json).expect("status JSON");
    assert_eq!(parsed.pods.len(), 2);
    assert_eq!(parsed.admission.count, 5);
    let table = hypervisor::status_table::render_table(&parsed);
    assert!(table.contains(&a) && table.contains("GRANTED"), "{table}");
    assert_eq!(
        call("GET", &format!("{url}/healthz"), None, None),
        (200, "ok".to_owned())
    );
    let _: Registered =
        serde_json::from_str(&register(&url, &b, &token_of(&b), 1).1).expect("b registers");
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
        vec![hypervisor_observer::ProcessMemory {
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
    // Charged to the pod as driver-held memory: its processes' next
    // reservations and reports count it.
    assert_eq!(seen.memory_unaccounted, 2 << 30, "{seen:?}");
    let (_, metrics) = call("GET", &format!("{}/metrics", h.url()), None, None);
    assert!(
        metrics.contains("gpushare_pod_memory_nvml_bytes{") && metrics.contains(" 2147483648"),
        "{metrics}"
    );
    assert!(
        metrics.lines().any(
            |line| line.starts_with("gpushare_pod_memory_unaccounted_bytes{")
                && line.ends_with(" 2147483648")
        ),
        "{metrics}"
    );
    // Reported now: no longer flagged.
    region
        .0
        .try_reserve(region.entry(0), 2 << 30)
        .expect("reserve");
    assert!(wait_for(Duration::from_secs(5), || !gpu_status()
        .memory_under_reported));
    assert!(
        wait_for(Duration::from_secs(5), || gpu_status().memory_unaccounted
            == 0),
        "{:?}",
        gpu_status()
    );
}
