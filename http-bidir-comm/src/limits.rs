//! Bounds on a server's HTTP connections, which the daemon's configuration
//! sets and the server's `conn` enforces.

use std::time::Duration;

/// Bounds on a server's HTTP connections (the daemon's file sets them as
/// `max_connections`, `header_timeout_ms`, `idle_timeout_ms`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConnLimits {
    /// Open connections at most (at least 16); past it, the oldest one
    /// still sending its headers is closed.
    pub max_connections: usize,
    /// How long a request's headers may take to arrive (at least 100 ms).
    pub header_timeout: Duration,
    /// How long a kept-alive connection may sit idle before it is closed
    /// (at least 100 ms).
    pub idle_timeout: Duration,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            max_connections: 4096,
            header_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(60),
        }
    }
}
