//! The files a config reads, its own and its token files: each read as a
//! [`small_file`] (a regular file, opened without waiting, of bounded
//! size; a FIFO or `/dev/zero` is refused at once), and the whole load
//! given [`LOAD_TIMEOUT`], so that a reload never holds the daemon.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use gpushare_utils::small_file::{self, TOKEN_FILE_MAX};

use super::ConfigError;

/// The most a config file may hold: thousands of pods.
pub const CONFIG_MAX_BYTES: u64 = 1 << 20;

/// The longest a load (the config and its token files) may take. Local
/// files take microseconds; one on a file system that stopped answering
/// would hold the caller (a reload, on the runtime that serves the API and
/// hears SIGTERM) for as long as it hangs.
pub const LOAD_TIMEOUT: Duration = Duration::from_secs(2);

/// The config file's text.
pub(super) fn read_config(path: &Path) -> Result<String, ConfigError> {
    small_file::read_text(path, CONFIG_MAX_BYTES).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })
}

/// The text of `what`'s token file at `path`.
pub(super) fn read_token(what: &str, path: &Path) -> Result<String, ConfigError> {
    small_file::read_text(path, TOKEN_FILE_MAX).map_err(|source| ConfigError::TokenFile {
        what: what.to_owned(),
        path: path.to_owned(),
        source,
    })
}

/// What `load` gives for the config at `path`, or a refusal once
/// [`LOAD_TIMEOUT`] has passed. The load runs on a thread of its own, left
/// behind if it hangs (it holds nothing of the daemon's): neither the
/// caller nor the runtime's shutdown waits for it.
pub(super) fn within_timeout<T: Send + 'static>(
    path: &Path,
    load: impl FnOnce() -> Result<T, ConfigError> + Send + 'static,
) -> Result<T, ConfigError> {
    let (done, result) = mpsc::sync_channel(1);
    std::thread::Builder::new()
        .name("config-load".to_owned())
        .spawn(move || {
            // The caller may have stopped waiting.
            let _ = done.send(load());
        })
        .map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source: source.into(),
        })?;
    result.recv_timeout(LOAD_TIMEOUT).unwrap_or_else(|_| {
        Err(ConfigError::Timeout {
            path: path.to_owned(),
            after: LOAD_TIMEOUT,
        })
    })
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_load_that_hangs_is_refused_after_the_timeout() {
        let started = Instant::now();
        let error = within_timeout(Path::new("slow.toml"), || {
            std::thread::sleep(LOAD_TIMEOUT * 3);
            Ok(())
        })
        .unwrap_err()
        .to_string();
        let took = started.elapsed();
        assert!(took >= LOAD_TIMEOUT && took < LOAD_TIMEOUT * 2, "{took:?}");
        assert!(error.starts_with("cannot read slow.toml"), "{error}");
        assert_eq!(within_timeout(Path::new("fast.toml"), || Ok(7)).unwrap(), 7);
    }
}
