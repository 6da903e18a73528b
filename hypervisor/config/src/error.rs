//! Why a config file or a limits body is refused: one line each, naming
//! the field and at most 200 characters of the value given.

use std::path::PathBuf;
use std::time::Duration;

use gpushare_utils::quote::{ClippedPath, ClippedRuns, escaped, quoted};
use gpushare_utils::small_file::SmallFileError;
use hypervisor_core::spec::SpecError;

/// Why a config (or a limits body) is refused. One line each.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// A key of the `[swap]` table has a value it cannot take.
    #[error("[swap]: invalid {0}")]
    Swap(String),
    /// The config file could not be read: missing, not a regular file, over
    /// [`CONFIG_MAX_BYTES`](crate::CONFIG_MAX_BYTES), not UTF-8, or no thread to read it on.
    #[error("cannot read {}: {source}", ClippedPath(path))]
    Read {
        /// The config file.
        path: PathBuf,
        /// Why it could not be read.
        #[source]
        source: SmallFileError,
    },
    /// Reading the file and its token files took longer than
    /// [`LOAD_TIMEOUT`]: a file system is hanging. The config in force stays.
    #[error(
        "cannot read {} and its token files within {}s: a file system is not answering",
        ClippedPath(path),
        after.as_secs()
    )]
    Timeout {
        /// The config file.
        path: PathBuf,
        /// The timeout it ran past ([`LOAD_TIMEOUT`]).
        after: Duration,
    },
    /// The file is not valid TOML or has a key or type the config does not
    /// know.
    #[error("{}: {}", ClippedPath(path), ClippedRuns(message))]
    Syntax {
        /// The config file.
        path: PathBuf,
        /// The parser's message on one line; its quoted runs are clipped
        /// when shown.
        message: String,
    },
    /// `listen` is not an `IP:port`; the value given.
    #[error("listen = {} is not an IP:port such as 127.0.0.1:7070", quoted(.0))]
    Listen(String),
    /// A token is set in none of its three ways, or in more than one (a
    /// pod's token is required; the admin token is optional).
    #[error("{what}: set exactly one of {keys}")]
    TokenSource {
        /// Whose token: `admin token` or `pod "a"`.
        what: String,
        /// The keys of which exactly one must be set.
        keys: &'static str,
    },
    /// A `token_file` (or `admin_token_file`) could not be read; relative
    /// paths are under the config file's folder.
    #[error("{what}: cannot read token file {}: {source}", ClippedPath(path))]
    TokenFile {
        /// Whose token: `admin token` or `pod "a"`.
        what: String,
        /// The token file, as resolved.
        path: PathBuf,
        /// Why it could not be read (missing, not a regular file, over
        /// 4 KiB).
        #[source]
        source: SmallFileError,
    },
    /// A `token_env` (or `admin_token_env`) names a variable the daemon's
    /// environment does not have (or that is not UTF-8).
    #[error("{what}: environment variable {} is not set", escaped(var))]
    TokenEnv {
        /// Whose token: `admin token` or `pod "a"`.
        what: String,
        /// The variable's name.
        var: String,
    },
    /// A value the spec refuses: pod id, token, weight, cap, share, GPU.
    #[error("{what}: {source}")]
    Spec {
        /// Where: `admin token`, `pod "a"` or `pod "a" gpu #2`.
        what: String,
        /// Which value, and why.
        #[source]
        source: SpecError,
    },
    /// A `memory` or `spill_limit` that is not a size (bytes, or a string
    /// such as `"4g"`).
    #[error("{what}: memory {source}")]
    Size {
        /// Where: `pod "a" gpu #2`.
        what: String,
        /// Why the size was refused.
        #[source]
        source: gpushare_utils::units::SizeError,
    },
    /// A GPU table with both `uuid` and `index`, or with neither.
    #[error("{what}: set exactly one of uuid and index")]
    GpuSelector {
        /// Where: `pod "a" gpu #2`.
        what: String,
    },
    /// A `class` other than `latency` or `batch`.
    #[error("{what}: class {} is not latency or batch", quoted(value))]
    Class {
        /// Where: `pod "a" gpu #2`.
        what: String,
        /// The value given.
        value: String,
    },
    /// A `policy` other than `fixed`, `elastic` or `none`.
    #[error("{what}: policy {} is not fixed, elastic or none", quoted(value))]
    Policy {
        /// Where: `pod "a" gpu #2`.
        what: String,
        /// The value given.
        value: String,
    },
    /// `region_mode` is not octal permission bits, or it lets the group or
    /// others write the regions; the value given.
    #[error(
        "region_mode {} must be octal permission bits without g+w or o+w, such as \"0640\"",
        quoted(.0)
    )]
    RegionMode(String),
    /// The pod list as a whole is refused: two pods with one id.
    #[error("{0}")]
    Pods(SpecError),
}
