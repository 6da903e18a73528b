//! How soon a parked long-poll returns once a task is submitted for its
//! client: hub on loopback, blocking client on a thread. Printed, not
//! asserted (tests/it/channel.rs checks that the poll returns on the submit
//! rather than at the end of its wait).
//!
//!     cargo bench -p http-bidir-comm --bench long_poll
//!     cargo bench --profile dev -p http-bidir-comm --bench long_poll

#![allow(
    clippy::unwrap_used,
    reason = "a benchmark stops at its first failure, by panicking"
)]

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::thread;
use std::time::{Duration, Instant};

use common::{TestServer, fast_options};
use http_bidir_comm::{Client, ClientId, Hub, HubConfig};
use system_tests::wait::wait_for;

const ROUNDS: usize = 50;

fn main() {
    // `cargo bench` passes `--bench` (and any filter); there is nothing to select.
    let (hub, _events) = Hub::<u32, u32>::new(HubConfig::default());
    let server = TestServer::start(&hub);
    let client = Client::new(&server.url(), "bench", fast_options()).expect("client");
    let me = ClientId::new("bench").expect("id");

    let mut latencies = Vec::with_capacity(ROUNDS);
    for n in 0..ROUNDS as u32 {
        let poller = {
            let client = client.clone();
            thread::spawn(move || {
                let tasks = client.poll_wait::<u32>(Duration::from_secs(10));
                (tasks, Instant::now())
            })
        };
        // Submit only once the poll is parked on the server.
        assert!(
            wait_for(Duration::from_secs(5), || hub
                .client(&me)
                .is_some_and(|c| c.polling)),
            "the poll never parked"
        );
        thread::sleep(Duration::from_millis(20));
        let submitted_at = Instant::now();
        hub.submit(&me, n).expect("submit");
        let (tasks, returned_at) = poller.join().expect("poller");
        let tasks = tasks.expect("poll");
        assert_eq!(tasks.len(), 1, "round {n}");
        latencies.push(returned_at - submitted_at);
    }
    latencies.sort();
    let at = |q: f64| latencies[((latencies.len() as f64 * q) as usize).min(latencies.len() - 1)];
    println!(
        "submit → long-poll return, {ROUNDS} rounds: median {:?}, p90 {:?}, max {:?}, min {:?}; {} build",
        at(0.5),
        at(0.9),
        latencies[latencies.len() - 1],
        latencies[0],
        if cfg!(debug_assertions) {
            "unoptimized"
        } else {
            "optimized"
        }
    );
}
