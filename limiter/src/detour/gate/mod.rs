//! Copies, sets, synchronisations and queries: calls that use the GPU
//! without allocating or launching. They only wait while the pod is
//! swapped out (`crate::residency`), then pass through unchanged.

mod hooks;
mod ops;

pub(crate) use hooks::GATE_DETOURS;
