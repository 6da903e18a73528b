//! The daemon's integration tests, one binary: the `hypervisor` binary as
//! operators run it (config, signals, listeners, abuse), its API, the
//! co-run daemons it supervises. Its Kubernetes modes on the official
//! control plane are system tests (`system-tests/tests/it/cluster/`).

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod common;

mod abuse;
mod api_admin;
mod api_auth;
mod api_fuzz;
mod api_routes;
mod corun;
mod faults;
mod hostile_config;
mod latency;
mod limiter_install;
mod listeners;
mod node_tables;
mod oversubscription;
mod residency;
mod scheduling;
mod squats;
mod turns;
