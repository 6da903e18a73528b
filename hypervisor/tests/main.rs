//! The hypervisor's integration tests, one test binary (`integration` in
//! Cargo.toml) whose modules are the files beside this one: each binary
//! links the whole daemon, kube and tokio, so one of them is built and
//! linked, not twenty. Run one module with a filter:
//! `cargo test -p hypervisor --test integration kubernetes::`.
//!
//! The tests share one process and run on parallel threads, so none may
//! count on being alone in it: names in `/dev/shm` and the temp dir come
//! from [`common::unique`] (or a [`common::scratch::Scratch`]), servers
//! listen on ephemeral ports, nothing sets environment variables or signal
//! handlers of the process, and child processes are the test's own, by pid.
//!
//! A new file here is a module: declare it below (Cargo.toml has
//! `autotests = false`, so a file not declared is never built).

mod common;

mod abuse;
mod api_admin;
mod api_auth;
mod api_fuzz;
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
