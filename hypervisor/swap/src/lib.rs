//! Swap: a pod's device memory moved to host memory and back, by the
//! driver's checkpoint API, so that an idle pod gives its GPU memory to
//! others and comes back with exactly what it had.
//!
//! [`driver`] loads the API and calls it on processes by pid; [`engine`]
//! swaps all processes of a pod together (lock all, checkpoint all;
//! restore all, unlock all), undoing a half-done swap-out, and restores a
//! pod onto another GPU (a move); [`host`] says whether the host can take a
//! swap-out; [`policy`] chooses the idle pods that make room on a GPU,
//! ranked by their [`uses`] as the daemon samples them; [`asks`] keeps the
//! swapped pods waiting for room in the order they asked; [`board`] keeps
//! each pod's swap history for the status and metrics (where the pod is,
//! its limits object alone says), and [`serving`] the node's swaps by
//! cause and its waits. Which pods exist, what
//! they hold and when they last called CUDA is the daemon's to say: this
//! crate knows pids and bytes only.

pub mod asks;
pub mod board;
pub mod driver;
pub mod engine;
pub mod host;
pub mod policy;
pub mod serving;
pub mod uses;

pub use board::{Move, PodSwap, SwapBoard, SwapHistory, SwapPath, SwapReport, SwapTotals, Swapped};
pub use driver::{CheckpointDriver, DriverError, ProcessState, RawUuid, parse_uuid};
pub use engine::{SwapError, Timing, move_pairs, restore_all, swap_in, swap_out, unlock_all};
pub use host::{HOST_RESERVE, HostShort};
pub use policy::{
    Candidate, LatencyPods, READY_SOON_MS, Ranking, RoomFor, RoomPolicy, RoomStep, ahead,
    give_back_order, prepare_next, ranked, ready_soon, room_ever, room_now, room_step, stamp_age,
    victims,
};
pub use serving::{
    Direction, ResidentPod, ServingBoard, ServingReport, SwapCause, SwapEvent, WaitCause, Waits,
};
pub use uses::{PodUses, Uses};
