//! Launches: every kernel and graph launch API, admitted against the pod's
//! compute budget.

mod hooks;
mod ops;

pub(crate) use hooks::LAUNCH_DETOURS;
