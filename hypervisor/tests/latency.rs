//! Admission latency on loopback with 100 registered workers. A test binary
//! of its own, so that no other test shares the two cores meanwhile.
//!
//! The requirement (p50 ≤ 200 µs, p99 ≤ 2 ms, measured at the client) is
//! asserted as is when the test is built with optimizations
//! (`cargo test --release`), or when `HV_LATENCY_STRICT` is set (for a
//! profile that optimizes the dependencies only). In the unoptimized test
//! profile, poem and hyper alone take 100–200 µs per loopback round trip on
//! a small machine (a `GET /healthz` is measured and printed for
//! comparison), so there the client-side p50 is held to three times the
//! requirement, and the requirement itself to the server-side histogram
//! (request in to answer out, inside the hypervisor).

mod common;

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::*;
use gpushare_utils::bucket::monotonic_ns;

const P50: Duration = Duration::from_micros(200);
/// The tests of this file take turns: each measures alone.
static ALONE: std::sync::Mutex<()> = std::sync::Mutex::new(());
const P99: Duration = Duration::from_millis(2);

fn quantiles(mut latencies: Vec<Duration>) -> (Duration, Duration, Duration) {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    (at(0.50), at(0.99), latencies[latencies.len() - 1])
}

/// 100 registered workers of 4 pods on one simulated GPU; each request is a
/// trap as the limiter makes it (bucket emptied just before).
#[test]
fn admission_latency_with_100_workers() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    const PODS: usize = 4;
    const WORKERS: usize = 100;
    const REQUESTS: usize = 2000;
    let pods: Vec<String> = (0..PODS).map(|i| unique(&format!("lat{i}"))).collect();
    let config: String = pods
        .iter()
        .enumerate()
        .map(|(i, p)| {
            pod_toml(
                p,
                &[&format!(
                    "index = 0\nweight = {}\npolicy = \"fixed\"\nmemory = \"1g\"",
                    i + 1
                )],
            )
        })
        .collect();
    let names: Vec<&str> = pods.iter().map(String::as_str).collect();
    let h = Harness::start(&config, 1, &names);
    let workers: Vec<(String, usize)> = (0..WORKERS)
        .map(|i| (register_ok(&h.url(), &pods[i % PODS]).worker_id, i % PODS))
        .collect();
    assert_eq!(h.hv.hypervisor().status().workers.len(), WORKERS);
    let regions: Vec<RegionView> = pods.iter().map(|p| RegionView::open(p)).collect();
    let tokens: Vec<String> = pods.iter().map(|p| token_of(p)).collect();
    let uuid = gpu(0);
    let mut client = RawClient::new(h.addr());

    // The floor: a request that does nothing, on the same connection.
    let floor: Vec<Duration> = (0..500)
        .map(|_| {
            let start = Instant::now();
            let (status, _) = client.request("GET", "/healthz", "-", "");
            assert_eq!(status, 200);
            start.elapsed()
        })
        .collect();
    let (floor_p50, floor_p99, _) = quantiles(floor);

    let mut latencies = Vec::with_capacity(REQUESTS);
    let bodies: Vec<String> = workers
        .iter()
        .map(|(w, _)| format!("{{\"worker_id\":\"{w}\",\"uuid\":\"{uuid}\",\"cost_ns\":20000}}"))
        .collect();
    let started = Instant::now();
    for n in 0..REQUESTS + 100 {
        let k = n % WORKERS;
        let pod = workers[k].1;
        let bucket = regions[pod].bucket(0);
        // The trap: the launch found the bucket empty.
        bucket.tokens_ns.store(0, Ordering::Release);
        bucket
            .refilled_at_ns
            .store(monotonic_ns(), Ordering::Release);
        let start = Instant::now();
        let (status, reply) = client.request("POST", "/api/v1/admission", &tokens[pod], &bodies[k]);
        let took = start.elapsed();
        assert_eq!(status, 200, "{reply}");
        assert!(!reply.contains("\"granted_ns\":0}"), "no budget: {reply}");
        // The first 100 warm up connections, allocations, the timer thread.
        if n >= 100 {
            latencies.push(took);
        }
    }
    let wall = started.elapsed();
    let (p50, p99, max) = quantiles(latencies);
    let server = h.hv.hypervisor().status().admission;
    let server_p50 = server.quantile_bound_us(0.5).unwrap_or(u64::MAX);
    let server_p99 = server.quantile_bound_us(0.99).unwrap_or(u64::MAX);
    let optimized = !cfg!(debug_assertions) || std::env::var_os("HV_LATENCY_STRICT").is_some();
    println!(
        "admission latency, {WORKERS} workers of {PODS} pods, {REQUESTS} requests in {wall:?}: \
         p50 {p50:?}, p99 {p99:?}, max {max:?} (client side, loopback); \
         server side p50 ≤ {server_p50} µs, p99 ≤ {server_p99} µs; \
         GET /healthz p50 {floor_p50:?}, p99 {floor_p99:?}; {} build",
        if optimized {
            "optimized"
        } else {
            "unoptimized"
        }
    );
    assert!(p99 <= P99, "p99 {p99:?}");
    assert!(
        server_p50 <= P50.as_micros() as u64,
        "server side p50 ≤ {server_p50} µs"
    );
    assert!(
        server_p99 <= P99.as_micros() as u64,
        "server side p99 ≤ {server_p99} µs"
    );
    if optimized {
        assert!(p50 <= P50, "p50 {p50:?}");
    } else {
        assert!(p50 <= P50 * 3, "p50 {p50:?} (unoptimized build)");
    }
}

/// Requests of several clients at once: still answered within the p99 bound.
#[test]
fn concurrent_admissions_stay_bounded() {
    let _alone = ALONE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    const CLIENTS: usize = 4;
    const REQUESTS: usize = 300;
    let pod = unique("conc");
    let h = Harness::start(
        &pod_toml(&pod, &["index = 0\npolicy = \"fixed\"\nweight = 1"]),
        1,
        &[&pod],
    );
    let token = token_of(&pod);
    let region = RegionView::open(&pod);
    let workers: Vec<String> = (0..CLIENTS)
        .map(|_| register_ok(&h.url(), &pod).worker_id)
        .collect();
    let latencies: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = workers
            .iter()
            .map(|w| {
                let (token, region, addr) = (&token, &region, h.addr());
                s.spawn(move || {
                    let mut client = RawClient::new(addr);
                    let body = format!(
                        "{{\"worker_id\":\"{w}\",\"uuid\":\"{}\",\"cost_ns\":1000}}",
                        gpu(0)
                    );
                    (0..REQUESTS)
                        .map(|_| {
                            region.bucket(0).tokens_ns.store(0, Ordering::Release);
                            let start = Instant::now();
                            let (status, reply) =
                                client.request("POST", "/api/v1/admission", token, &body);
                            assert_eq!(status, 200, "{reply}");
                            start.elapsed()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("client"))
            .collect()
    });
    let (p50, p99, max) = quantiles(latencies);
    println!("{CLIENTS} concurrent clients: p50 {p50:?}, p99 {p99:?}, max {max:?}");
    // Four clients on two shared cores queue behind one another.
    assert!(p99 <= P99 * 5, "p99 {p99:?}");
}
