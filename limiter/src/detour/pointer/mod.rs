//! Pointer queries: what the driver says of an address, answered for the
//! memory the limiter backs itself (`crate::backing`) as for memory of
//! `cuMemAlloc_v2`: the base and size the program asked for.

mod hooks;
mod ops;

pub(crate) use hooks::POINTER_DETOURS;
