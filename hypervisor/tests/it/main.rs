//! The daemon's integration tests, one binary: each module was once a test
//! file of its own. The `hypervisor` binary as operators run it (config,
//! signals, listeners, abuse), its API, and the Kubernetes modes against the
//! official control plane.

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
mod corun_provision;
mod device_health;
mod device_plugin;
mod faults;
mod hostile_config;
mod kubernetes;
mod latency;
mod limiter_install;
mod listeners;
mod node_tables;
mod overcommit;
mod oversubscription;
mod scheduling;
mod shared_claims;
mod squats;
mod turns;
