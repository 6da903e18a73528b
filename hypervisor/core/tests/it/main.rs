//! The daemon core's integration tests, one binary: the node tables and
//! the turn plan.

mod node_tables;
mod turn_flags;
mod turns;
