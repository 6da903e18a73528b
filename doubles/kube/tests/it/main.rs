//! The Kubernetes doubles' tests, one binary: the fake API server against
//! the official one and under upstream kubectl and the Python client, and the
//! k8s-e2e tool.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod common;

mod against_the_real_server;
mod apiserver;
mod k8s_e2e_tool;
mod kubectl;
mod python_client;
