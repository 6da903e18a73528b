//! The node agent end to end on the official control plane (API server,
//! scheduler, controller manager): DRA claims allocated by the real
//! scheduler and prepared by the agent, the device plugin's placement and
//! health, co-run GPUs, overcommit, and claims shared by several pods.
//!
//! Every test of the binary shares one control plane (`deploy/` installed
//! once, stopped when the binary exits), each in a namespace and on a Node
//! of its own ([`Tenant`], deleted when the test ends): its claims in its
//! namespace, its pods pinned to its Node, which only its own agent serves.

use kube_fakes::tenant::Tenant;

mod corun_provision;
mod device_health;
mod device_plugin;
mod kubernetes;
mod overcommit;
mod shared_claims;
mod tenant_cleanup;

/// The DRA driver's name, the shipped DeviceClass's.
pub(crate) const DRIVER: &str = "gpu.gpushare.dev";

/// The runtime a test runs its node and its clients on.
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// A namespace and a Node of their own, named after `tag`, on the shared
/// control plane.
pub(crate) async fn tenant(tag: &str) -> Tenant {
    let name = system_tests::unique::name(tag);
    Tenant::new(&name).await.unwrap_or_else(|e| panic!("{e:#}"))
}
