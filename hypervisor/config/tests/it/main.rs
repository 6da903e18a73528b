//! The config crate's integration tests, one binary: the file and the
//! admin limits body parsed.

mod config;
