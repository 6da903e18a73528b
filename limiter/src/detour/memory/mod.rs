//! Memory: quotas on every allocation API, credit on every free, and the
//! virtualised memory reports of the driver API.

mod hooks;
mod ops;
mod sizes;

pub(crate) use hooks::{MEMORY_DETOURS, driver_free};
