//! The node daemon's status as data: [`status`], the JSON model that
//! `GET /api/v1/status` answers and the `hypervisor status` command reads,
//! and [`metrics`], its Prometheus exposition for `/metrics`, with the
//! admission latency histogram the daemon records into. No I/O: the daemon
//! gathers the status and serves it.

pub mod metrics;
pub mod status;
