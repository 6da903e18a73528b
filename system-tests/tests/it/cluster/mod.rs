//! The node agent end to end on the official control plane (API server,
//! scheduler, controller manager): DRA claims allocated by the real
//! scheduler and prepared by the agent, the device plugin's placement and
//! health, co-run GPUs, overcommit, and claims shared by several pods.
//! Each test starts a control plane of its own.

mod corun_provision;
mod device_health;
mod device_plugin;
mod kubernetes;
mod overcommit;
mod shared_claims;
