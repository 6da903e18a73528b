//! The daemon core's integration tests, one binary: the config file, the
//! node tables, and the turn plan.

mod config;
mod node_tables;
mod turn_flags;
mod turns;
