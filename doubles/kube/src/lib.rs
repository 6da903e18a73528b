//! Test doubles of Kubernetes that run in-process on loopback: an API server
//! ([`apiserver`]) and a kubelet's plugin side ([`kubelet`] for DRA,
//! [`device_kubelet`] for device plugins). The hypervisor's tests, the
//! limiter's device-plugin test and the `k8s-e2e` tool drive the real agent
//! against them. A dev-only crate: the daemon never links it.

pub mod apiserver;
pub mod clients;
pub mod cluster;
pub mod cluster_node;
pub mod device_kubelet;
pub mod kubelet;
mod names;
pub mod node;
pub mod node_kubelet;
pub mod selector;
pub mod tenant;
