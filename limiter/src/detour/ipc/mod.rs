//! CUDA IPC: device memory one process exports and another maps, handled
//! by the limiter for the memory it backs itself (`crate::backing::ipc`),
//! which the driver's legacy IPC cannot export.

mod hooks;
mod ops;

pub(crate) use hooks::IPC_DETOURS;
