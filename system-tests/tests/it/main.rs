//! The system tests, one binary: the limiter, the daemon and the driver
//! double together, as a node runs them; the control-plane end-to-end tests;
//! the packaging, the deploy manifests and the GPU check's own tests.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod architecture;
mod attacks;
mod auto_turns;
mod cluster;
mod corun_gpus;
mod deploy;
mod device_plugin;
mod device_plugin_cluster;
mod dra_cluster;
mod driver_held;
mod examples;
mod fail_closed;
mod fast_move;
mod fast_swap;
mod gpu_harness;
mod hypervisor_mode;
mod moves;
mod mps_required;
mod node_table_attacks;
mod packaging;
mod provisioned;
mod readme_config;
mod swap;
mod swap_policy;
