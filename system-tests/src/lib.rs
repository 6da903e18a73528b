//! Support for the tests that run the system's parts together: the limiter
//! preloaded into the driver double's probe programs, the node daemon
//! in-process, the fake cluster. The tests themselves are this package's
//! `tests/`, with the repository's checks; the limiter's own tests use the
//! probe support too. Never shipped.
//!
//! A system test typically:
//!
//! 1. takes a [`pod::Pod`] of its own (its objects in `/dev/shm` are
//!    removed after it) and, with the `node` feature, starts a daemon for
//!    it ([`daemon::hypervisor`], a [`RunningNode`] on loopback seeing the
//!    double's GPUs, [`daemon::double_gpus`]);
//! 2. runs a probe program under the limiter as that pod
//!    ([`probes::probe`]; the limiter is built for the run by
//!    [`artifacts::limiter`]), or inside an emulated provisioned container
//!    ([`container::ContainerLib`]);
//! 3. compares the probe's lines with what the limits allow
//!    ([`probes::result_of`], [`probes::assert_share`], …).
//!
//! The `node` feature (on by default) brings the node daemon's crates: the
//! limiter's tests take this package without it, so that they do not build
//! the daemon.

pub mod artifacts;
pub mod container;
#[cfg(feature = "node")]
pub mod daemon;
pub mod fuzz;
#[cfg(feature = "node")]
mod node;
pub mod pod;
pub mod probes;
pub mod scratch;
#[cfg(feature = "node")]
pub mod swapping;
pub mod tools;
pub mod unique;
pub mod wait;

#[cfg(feature = "node")]
pub use node::RunningNode;
