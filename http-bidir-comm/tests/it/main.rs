//! The command channel's integration tests, one binary: end to end on
//! loopback and over a Unix socket, every refusal, and a seeded fuzz.

mod common;

mod channel;
mod errors;
mod fuzz;
mod unix_socket;
