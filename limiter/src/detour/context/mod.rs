//! Contexts: the memory the driver takes for a context, reserved in the
//! pod's quota before the driver creates it.

mod hooks;
mod ops;

pub(crate) use hooks::CONTEXT_DETOURS;
