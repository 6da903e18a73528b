//! Admission under the load the latency requirement is stated for: 100
//! registered workers, every request a trap with an empty bucket, and several
//! clients at once. These tests check behaviour only (every request answered,
//! with budget); how fast the answers come is measured and printed by
//! `cargo bench -p hypervisor --bench admission_latency`
//! (benches/admission_latency.rs), which runs the same two scenarios.

use crate::common;

use common::*;

/// 100 registered workers of 4 pods on one simulated GPU; each request is a
/// trap as the limiter makes it (bucket emptied just before). Every one is
/// answered 200 with budget: the bucket refills at the pod's rate while the
/// request waits, so none may come back empty-handed.
#[test]
fn admission_with_100_workers_grants_every_trap() {
    const REQUESTS: usize = 2000;
    let traps = Traps::start();
    assert_eq!(
        traps.h.hv.hypervisor().status().workers.len(),
        Traps::WORKERS
    );
    let mut client = RawClient::new(traps.h.addr());
    for n in 0..REQUESTS {
        let (status, reply) = traps.trap(&mut client, n);
        assert_eq!(status, 200, "request {n}: {reply}");
        let granted =
            serde_json::from_str::<serde_json::Value>(&reply).expect("json")["granted_ns"]
                .as_u64()
                .unwrap_or_else(|| panic!("request {n}: no granted_ns in {reply}"));
        assert!(granted > 0, "request {n}: no budget: {reply}");
    }
    // The daemon's own count agrees: every request recorded, none of them
    // answered empty after waiting out its admission window.
    let server = traps.h.hv.hypervisor().status().admission;
    assert_eq!(server.count, REQUESTS as u64);
    assert_eq!(server.timeouts, 0);
}

/// Requests of several clients at once, each on its own connection with its
/// own worker of one pod: every one is answered 200.
#[test]
fn concurrent_admissions_are_all_answered() {
    const CLIENTS: usize = 4;
    const REQUESTS: usize = 300;
    let (_h, answers) = concurrent_traps(CLIENTS, REQUESTS, |_| {});
    assert_eq!(answers.len(), CLIENTS * REQUESTS);
    for (n, (status, reply, _)) in answers.iter().enumerate() {
        assert_eq!(*status, 200, "request {n}: {reply}");
    }
}
