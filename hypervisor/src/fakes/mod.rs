//! Test doubles of Kubernetes that run in-process on loopback: an API server
//! ([`apiserver`]) and a kubelet's plugin side ([`kubelet`] for DRA,
//! [`device_kubelet`] for device plugins). The tests, the
//! `k8s-e2e` tool and the device plugin's tests drive the real agent against
//! them; nothing here is used by `hypervisor serve`.

pub mod apiserver;
mod apiserver_watch;
pub mod cluster;
pub mod device_kubelet;
pub mod kubelet;
pub mod node;
pub mod selector;
