//! Admission latency on loopback with 100 registered workers, and with four
//! clients at once: the figures behind the latency requirement, printed, not
//! asserted (a loaded machine is slow, not wrong; tests/it/latency.rs checks the
//! behaviour of the same two scenarios).
//!
//!     cargo bench -p hypervisor --bench admission_latency          # optimized
//!     cargo bench --profile dev -p hypervisor --bench admission_latency
//!
//! The requirement (p50 ≤ 200 µs, p99 ≤ 2 ms, measured at the client) holds
//! for a build with optimizations, as the daemon ships: `cargo bench` builds
//! one. In the unoptimized dev profile, poem and hyper alone take 100–200 µs
//! per loopback round trip on a small machine (a `GET /healthz` is measured
//! and printed for comparison), so there the client-side figures measure the
//! code generator more than the design; the server-side histogram (request in
//! to answer out, inside the hypervisor) is the one to hold to the
//! requirement. Each figure is printed with "meets" or "misses"; a miss is
//! reported, never a failure. Run it on an otherwise idle machine: other work
//! on the cores shows up in the tail.

#![allow(
    clippy::unwrap_used,
    reason = "a benchmark stops at its first failure, by panicking"
)]

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use hypervisor_status::status::LatencySnapshot;

const P50: Duration = Duration::from_micros(200);
const P99: Duration = Duration::from_millis(2);

fn quantiles(mut latencies: Vec<Duration>) -> (Duration, Duration, Duration) {
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    (at(0.50), at(0.99), latencies[latencies.len() - 1])
}

fn verdict(meets: bool) -> &'static str {
    if meets { "meets" } else { "misses" }
}

/// The server-side histogram of what was recorded between two snapshots.
fn since(before: &LatencySnapshot, after: &LatencySnapshot) -> LatencySnapshot {
    LatencySnapshot {
        buckets: after
            .buckets
            .iter()
            .zip(&before.buckets)
            .map(|(&(bound, a), &(_, b))| (bound, a - b))
            .collect(),
        count: after.count - before.count,
        sum_seconds: after.sum_seconds - before.sum_seconds,
        timeouts: after.timeouts - before.timeouts,
    }
}

/// Upper bounds (µs) of the histogram buckets holding p50 and p99.
fn server_bounds(server: &LatencySnapshot) -> (u64, u64) {
    (
        server.quantile_bound_us(0.5).unwrap_or(u64::MAX),
        server.quantile_bound_us(0.99).unwrap_or(u64::MAX),
    )
}

fn main() {
    // `cargo bench` passes `--bench` (and any filter); there is nothing to select.
    let optimized = !cfg!(debug_assertions);
    let build = if optimized {
        "optimized"
    } else {
        "unoptimized"
    };
    println!(
        "admission_latency bench, {build} build{}",
        if optimized {
            ""
        } else {
            " (client-side figures include unoptimized poem/hyper; judge the server side)"
        }
    );
    one_client_100_workers(build);
    concurrent_clients();
}

/// 100 registered workers of 4 pods on one simulated GPU; each request is a
/// trap as the limiter makes it (bucket emptied just before).
fn one_client_100_workers(build: &str) {
    const PODS: usize = Traps::PODS;
    const WORKERS: usize = Traps::WORKERS;
    const WARM_UP: usize = 100;
    const REQUESTS: usize = 2000;
    let traps = Traps::start();
    let h = &traps.h;
    let mut client = RawClient::new(h.addr());

    // The floor: a request that does nothing, on the same connection.
    let floor: Vec<Duration> = (0..500)
        .map(|_| {
            let start = Instant::now();
            let (status, _) = client.request("GET", "/healthz", "-", "");
            let took = start.elapsed();
            assert_eq!(status, 200, "GET /healthz");
            took
        })
        .collect();
    let (floor_p50, floor_p99, _) = quantiles(floor);

    let mut latencies = Vec::with_capacity(REQUESTS);
    let mut empty = 0usize;
    let mut before = None;
    let mut started = Instant::now();
    for n in 0..WARM_UP + REQUESTS {
        // The first requests warm up connections, allocations, the timer
        // thread; neither side counts them.
        if n == WARM_UP {
            before = Some(h.hv.hypervisor().status().admission);
            started = Instant::now();
        }
        let start = Instant::now();
        let (status, reply) = traps.trap(&mut client, n);
        let took = start.elapsed();
        assert_eq!(status, 200, "{reply}");
        if reply.contains("\"granted_ns\":0}") {
            empty += 1;
        }
        if n >= WARM_UP {
            latencies.push(took);
        }
    }
    let wall = started.elapsed();
    let (p50, p99, max) = quantiles(latencies);
    let after = h.hv.hypervisor().status().admission;
    let server = since(&before.expect("warmed up"), &after);
    let (server_p50, server_p99) = server_bounds(&server);
    // Kept in the form scripts/gpu/hvctl.py reads.
    println!(
        "admission latency, {WORKERS} workers of {PODS} pods, {REQUESTS} requests in {wall:?}: \
         p50 {p50:?}, p99 {p99:?}, max {max:?} (client side, loopback); \
         server side p50 ≤ {server_p50} µs, p99 ≤ {server_p99} µs; \
         GET /healthz p50 {floor_p50:?}, p99 {floor_p99:?}; {build} build"
    );
    println!(
        "  requirement p50 ≤ {P50:?}, p99 ≤ {P99:?}: client p50 {}, client p99 {}; \
         server-side p50 {}, server-side p99 {}; answered without budget: {empty}",
        verdict(p50 <= P50),
        verdict(p99 <= P99),
        verdict(server_p50 <= P50.as_micros() as u64),
        verdict(server_p99 <= P99.as_micros() as u64),
    );
}

/// Requests of several clients at once, each with its own worker and
/// connection, against one pod.
fn concurrent_clients() {
    const CLIENTS: usize = 4;
    const REQUESTS: usize = 300;
    let mut before = None;
    let (h, answers) = concurrent_traps(CLIENTS, REQUESTS, |h| {
        before = Some(h.hv.hypervisor().status().admission);
    });
    let before = before.expect("taken before the asks");
    let latencies: Vec<Duration> = answers
        .into_iter()
        .map(|(status, reply, took)| {
            assert_eq!(status, 200, "{reply}");
            took
        })
        .collect();
    let (p50, p99, max) = quantiles(latencies);
    let server = since(&before, &h.hv.hypervisor().status().admission);
    let (server_p50, server_p99) = server_bounds(&server);
    println!(
        "{CLIENTS} concurrent clients: p50 {p50:?}, p99 {p99:?}, max {max:?} (client side); \
         server side p50 ≤ {server_p50} µs, p99 ≤ {server_p99} µs"
    );
    // Four clients on two cores queue behind one another: the requirement is
    // stated for one client; this shows how far the tail stretches beyond it.
    println!(
        "  requirement p99 ≤ {P99:?}: client p99 {}, server-side p99 {}",
        verdict(p99 <= P99),
        verdict(server_p99 <= P99.as_micros() as u64),
    );
}
