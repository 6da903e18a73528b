//! Swap: a pod's device memory moved to host memory and back, by the
//! driver's checkpoint API, so that an idle pod gives its GPU memory to
//! others and comes back with exactly what it had.
//!
//! [`driver`] loads the API and calls it on processes by pid; [`engine`]
//! swaps all processes of a pod together (lock all, checkpoint all;
//! restore all, unlock all), undoing a half-done swap-out, and restores a
//! pod onto another GPU (a move); [`host`] says whether the host can take a
//! swap-out; [`policy`] chooses the idle pods that make room on a GPU;
//! [`board`] keeps each pod's swap history for the status and metrics
//! (where the pod is, its limits object alone says). Which pods exist, what
//! they hold and when they last called CUDA is the daemon's to say: this
//! crate knows pids and bytes only.

pub mod board;
pub mod driver;
pub mod engine;
pub mod host;
pub mod policy;

pub use board::{Move, PodSwap, SwapBoard, SwapHistory, SwapPath, SwapReport, SwapTotals, Swapped};
pub use driver::{CheckpointDriver, DriverError, ProcessState, RawUuid, parse_uuid};
pub use engine::{SwapError, Timing, move_pairs, restore_all, swap_in, swap_out, unlock_all};
pub use host::{HOST_RESERVE, HostShort};
pub use policy::{Candidate, LatencyPods, RoomPolicy, stamp_age, victims};
