//! The driver double's own tests, one binary: its entry points, probes,
//! copies, clocks, graphs, checkpoint API and the node file it reads.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a helper fails its test by panicking, as the test itself does"
)]

mod common;

mod checkpoint;
mod compute_clock;
mod compute_graphs;
mod compute_probes;
mod double_copies;
mod double_entry_points;
mod double_held;
mod double_in_process;
mod double_probes;
mod double_sharing;
mod double_vmm;
mod node_file;
