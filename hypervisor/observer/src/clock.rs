//! Wall-clock time for what the daemon reports (when a worker registered,
//! since when a GPU or an MPS daemon is in its state): seconds since the
//! Unix epoch, 0 if the clock is before it.

use std::time::{SystemTime, UNIX_EPOCH};

/// Now, in whole seconds since the Unix epoch.
pub fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    #[test]
    fn is_after_2020() {
        assert!(super::unix_secs() > 1_577_836_800);
    }
}
