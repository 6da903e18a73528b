//! Local-mode configuration of the limiter, read from environment variables.
//!
//! The limiter reads this once at load, in every process it is injected into
//! (including `ls`), so [`LimiterConfig::from_env`] walks the environment once
//! and only copies the variables it recognises. A broken value is a one-line
//! [`ConfigError`] naming the variable, the value and what was expected; it is
//! never silently ignored, because ignoring it would run the pod without limits.
//!
//! Besides our own `CUDA_LIMITER_*` variables, the variables of the systems
//! people migrate from are understood: HAMi (`CUDA_DEVICE_*`), TensorFusion
//! (`TENSOR_FUSION_*`), vcuda (`VCUDA_MEMORY_LIMIT`) and the older
//! `CUDA_MEM_LIMIT_<i>` / `CUDA_CORE_LIMIT_<i>` pair.
//!
//! `<i>` is the device index as the application sees it: the CUDA ordinal after
//! `CUDA_VISIBLE_DEVICES`, from 0 to 15 ([`MAX_DEVICES`] - 1), written without
//! leading zeros. A larger index is an error naming the variable.
//!
//! # Memory limits (bytes)
//!
//! | variable | scope | value |
//! | --- | --- | --- |
//! | `CUDA_LIMITER_MEMORY_LIMIT_<i>` | device `i` | size |
//! | `CUDA_DEVICE_MEMORY_LIMIT_<i>` (HAMi) | device `i` | size |
//! | `CUDA_MEM_LIMIT_<i>` | device `i` | size |
//! | `TENSOR_FUSION_CUDA_MEM_LIMIT` | the devices it names | JSON object, see below |
//! | `CUDA_LIMITER_MEMORY_LIMIT` | all devices | size |
//! | `CUDA_DEVICE_MEMORY_LIMIT` (HAMi) | all devices | size |
//! | `VCUDA_MEMORY_LIMIT` (vcuda) | all devices | size |
//!
//! A *size* is a whole number of bytes, optionally followed by a binary unit:
//! `k`, `m`, `g`, `t` (or `kb`/`kib`/`ki`, `mb`/`mib`/`mi`, ...; all mean
//! 1024^n, case-insensitive; `b` means bytes). Surrounding whitespace is
//! allowed; empty, negative, fractional and overflowing values are errors. See
//! [`parse_size`].
//!
//! `TENSOR_FUSION_CUDA_MEM_LIMIT` is a JSON object keyed by GPU UUID
//! (`GPU-…` or `MIG-…`, case-insensitive) or by device index (`"0"`), whose
//! values are bytes as JSON integers or size strings (`"4g"`), e.g.
//! `{"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824}` or
//! `{"0": 2147483648}`. `{}` is valid and sets nothing. Two keys naming the same
//! UUID in different case are an error.
//!
//! # Compute limits (percent of SM time)
//!
//! | variable | scope | value |
//! | --- | --- | --- |
//! | `CUDA_LIMITER_SM_LIMIT_<i>` | device `i` | percent |
//! | `CUDA_LIMITER_SM_POLICY_<i>` | device `i` | `fixed`, `elastic` or `none` |
//! | `CUDA_LIMITER_SM_SOFT_LIMIT_<i>` | device `i` | percent, the elastic ceiling |
//! | `CUDA_DEVICE_SM_LIMIT_<i>` (HAMi) | device `i` | percent |
//! | `CUDA_CORE_LIMIT_<i>` | device `i` | percent |
//! | `CUDA_CORE_SOFT_LIMIT_<i>` | device `i` | percent, the elastic ceiling |
//! | `TENSOR_FUSION_CUDA_UP_LIMIT` | the devices it names | JSON object of integer percents, keyed like `TENSOR_FUSION_CUDA_MEM_LIMIT` |
//! | `CUDA_LIMITER_SM_LIMIT` | all devices | percent |
//! | `CUDA_LIMITER_SM_POLICY` | all devices | `fixed`, `elastic` or `none` |
//! | `CUDA_LIMITER_SM_SOFT_LIMIT` | all devices | percent, the elastic ceiling |
//! | `CUDA_DEVICE_SM_LIMIT` (HAMi) | all devices | percent |
//!
//! A *percent* is a whole number from 0 to 100 (a trailing `%` and surrounding
//! whitespace are allowed); 0 and 100 mean unlimited.
//!
//! Our policy and soft limit go with our limit: for device `i`, the limit is
//! `CUDA_LIMITER_SM_LIMIT_<i>` else `CUDA_LIMITER_SM_LIMIT`, the policy
//! `CUDA_LIMITER_SM_POLICY_<i>` else `CUDA_LIMITER_SM_POLICY`, the soft limit
//! `CUDA_LIMITER_SM_SOFT_LIMIT_<i>` else `CUDA_LIMITER_SM_SOFT_LIMIT`; setting
//! any of the three `_<i>` variables makes a per-device key for device `i`.
//! - policy `none` means unlimited, whatever the limit;
//! - `fixed` caps the device at the limit; a soft limit is ignored;
//! - `elastic` may use idle SM time up to the soft limit (100 when unset);
//! - no policy: `elastic` when a soft limit above the limit is set, else `fixed`;
//! - a soft limit below the limit is an error, and so is a policy (other than
//!   `none`) or soft limit with no limit to apply to.
//!
//! `CUDA_CORE_SOFT_LIMIT_<i>` is the elastic ceiling of `CUDA_CORE_LIMIT_<i>`:
//! above the limit it makes the device elastic, equal it keeps it fixed, below
//! it (or without `CUDA_CORE_LIMIT_<i>`) it is an error.
//!
//! # Precedence
//!
//! For device `i` with UUID `u`, the first key set wins, per-device keys before
//! all-devices keys:
//!
//! | | memory | compute |
//! | --- | --- | --- |
//! | 1 | `CUDA_LIMITER_MEMORY_LIMIT_<i>` | `CUDA_LIMITER_SM_LIMIT_<i>` (and `_POLICY_<i>`, `_SOFT_LIMIT_<i>`) |
//! | 2 | `CUDA_DEVICE_MEMORY_LIMIT_<i>` | `CUDA_DEVICE_SM_LIMIT_<i>` |
//! | 3 | `CUDA_MEM_LIMIT_<i>` | `CUDA_CORE_LIMIT_<i>` (and `CUDA_CORE_SOFT_LIMIT_<i>`) |
//! | 4 | `TENSOR_FUSION_CUDA_MEM_LIMIT[u]` | `TENSOR_FUSION_CUDA_UP_LIMIT[u]` |
//! | 5 | `TENSOR_FUSION_CUDA_MEM_LIMIT["<i>"]` | `TENSOR_FUSION_CUDA_UP_LIMIT["<i>"]` |
//! | 6 | `CUDA_LIMITER_MEMORY_LIMIT` | `CUDA_LIMITER_SM_LIMIT` (and `_POLICY`, `_SOFT_LIMIT`) |
//! | 7 | `CUDA_DEVICE_MEMORY_LIMIT` | `CUDA_DEVICE_SM_LIMIT` |
//! | 8 | `VCUDA_MEMORY_LIMIT` | |
//!
//! A value meaning unlimited (size 0, percent 0 or 100, policy `none`) is still
//! a key: it shadows every key below it for that device, and
//! [`DeviceLimits::resolve`] returns `None` for it
//! ([`DeviceLimits::lookup`] tells it from "unset").
//!
//! # Other
//!
//! | variable | value |
//! | --- | --- |
//! | `CUDA_LIMITER_POD` | pod identity, see [`PodId`]; default `default` |
//! | `CUDA_LIMITER_HYPERVISOR` | hypervisor address, e.g. `http://127.0.0.1:8000`; unset means local mode |
//!
//! Other `CUDA_LIMITER_*` names (typos included) are ignored, except a variable
//! of ours with a device suffix that is not an index (`CUDA_LIMITER_MEMORY_LIMIT_x`),
//! which is an error. Foreign variables with a non-numeric suffix belong to
//! their own systems and are ignored; a foreign suffix that starts with a digit
//! but is not a valid index (`CUDA_MEM_LIMIT_01`, `CUDA_MEM_LIMIT_16`) is an error.

use std::ffi::OsStr;
use std::fmt;
use std::str::FromStr;

/// The most devices a process can have limits for; device indices are `0..MAX_DEVICES`.
pub const MAX_DEVICES: usize = 16;

const SIZE_SYNTAX: &str = "bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k";
const PERCENT_SYNTAX: &str = "a whole number from 0 to 100; 0 and 100 mean unlimited";
const POD_SYNTAX: &str = "1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-'";
const JSON_KEY_SYNTAX: &str = "a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15";
const MEM_JSON_EXAMPLE: &str =
    r#"{"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"}"#;
const UP_JSON_EXAMPLE: &str = r#"{"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 50} or {"0": 30}"#;
const MEM_JSON_VALUE: &str = "bytes as a whole number or a size string such as \"4g\"";
const UP_JSON_VALUE: &str = "a whole-number percent from 0 to 100";

/// Identity of a pod: 1 to 64 characters of `[A-Za-z0-9_.-]`.
///
/// Processes with the same pod id share one quota.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodId(String);

impl PodId {
    /// Longest accepted pod id, in bytes.
    pub const MAX_LEN: usize = 64;

    /// Validates `id` (no trimming).
    pub fn new(id: impl Into<String>) -> Result<Self, InvalidPodId> {
        let id = id.into();
        let valid = (1..=Self::MAX_LEN).contains(&id.len())
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if valid {
            Ok(Self(id))
        } else {
            Err(InvalidPodId(id))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for PodId {
    /// The pod of processes started without `CUDA_LIMITER_POD`: `default`.
    fn default() -> Self {
        Self("default".to_owned())
    }
}

impl fmt::Display for PodId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for PodId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl FromStr for PodId {
    type Err = InvalidPodId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

/// A string that is not a valid [`PodId`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} is not a pod id (expected {POD_SYNTAX})", quoted(.0))]
pub struct InvalidPodId(String);

/// How a compute limit treats SM time other pods leave idle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ComputePolicy {
    /// Never more than the limit.
    #[default]
    Fixed,
    /// At least the limit when contended; idle time up to the soft limit.
    Elastic,
    /// No compute limit. Parsed from the environment, never stored in a
    /// [`ComputeLimit`]: it resolves to "unlimited".
    None,
}

impl ComputePolicy {
    /// `fixed`, `elastic` or `none`, case-insensitive, surrounding whitespace allowed.
    pub fn parse(s: &str) -> Option<Self> {
        let s = s.trim();
        [
            ("fixed", Self::Fixed),
            ("elastic", Self::Elastic),
            ("none", Self::None),
        ]
        .into_iter()
        .find_map(|(name, policy)| name.eq_ignore_ascii_case(s).then_some(policy))
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fixed => "fixed",
            Self::Elastic => "elastic",
            Self::None => "none",
        }
    }
}

impl fmt::Display for ComputePolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A limited share of one device's SM time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ComputeLimit {
    /// Guaranteed (elastic) or maximum (fixed) share, 1 to 99.
    pub percent: u8,
    /// [`ComputePolicy::Fixed`] or [`ComputePolicy::Elastic`].
    pub policy: ComputePolicy,
    /// Elastic ceiling, `percent..=99`; `None` means the whole device. Always
    /// `None` under [`ComputePolicy::Fixed`].
    pub soft_percent: Option<u8>,
}

impl ComputeLimit {
    /// A fixed limit of `percent`.
    pub fn fixed(percent: u8) -> Self {
        Self {
            percent,
            policy: ComputePolicy::Fixed,
            soft_percent: None,
        }
    }

    /// The most SM time the pod may use: the limit when fixed, the soft limit
    /// (or 100) when elastic.
    pub fn ceiling(&self) -> u8 {
        match self.policy {
            ComputePolicy::Elastic => self.soft_percent.unwrap_or(100),
            ComputePolicy::Fixed | ComputePolicy::None => self.percent,
        }
    }
}

/// Which devices a key applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Device {
    All,
    Index(u32),
    /// Lowercased.
    Uuid(String),
}

impl Device {
    fn matches(&self, index: u32, uuid: Option<&str>) -> bool {
        match self {
            Self::All => true,
            Self::Index(i) => *i == index,
            Self::Uuid(u) => uuid.is_some_and(|x| x.eq_ignore_ascii_case(u)),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry<T> {
    rank: u8,
    device: Device,
    /// `None`: explicitly unlimited.
    limit: Option<T>,
    source: String,
}

/// The key that decided a device's limit, from [`DeviceLimits::lookup`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved<'a, T> {
    /// `None`: the key says "unlimited" (e.g. a size of 0).
    pub limit: Option<T>,
    /// The variable (and JSON key) it came from, e.g. `CUDA_DEVICE_MEMORY_LIMIT_0`
    /// or `TENSOR_FUSION_CUDA_MEM_LIMIT["gpu-…"]`.
    pub source: &'a str,
}

/// Limits keyed by device index, by GPU UUID and for all devices, resolved in
/// the precedence order of the module documentation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceLimits<T> {
    /// Sorted by rank (lower wins); entries of one rank never name the same device.
    entries: Vec<Entry<T>>,
}

impl<T> Default for DeviceLimits<T> {
    fn default() -> Self {
        Self {
            entries: Vec::new(),
        }
    }
}

impl<T> DeviceLimits<T> {
    fn push(&mut self, rank: u8, device: Device, limit: Option<T>, source: String) {
        let at = self.entries.partition_point(|e| e.rank <= rank);
        self.entries.insert(
            at,
            Entry {
                rank,
                device,
                limit,
                source,
            },
        );
    }
}

impl<T: Copy> DeviceLimits<T> {
    /// The limit of device `index` (CUDA ordinal) with GPU UUID `uuid`; `None`
    /// when unset or explicitly unlimited.
    pub fn resolve(&self, index: u32, uuid: Option<&str>) -> Option<T> {
        self.lookup(index, uuid).and_then(|r| r.limit)
    }

    /// The key that decides device `index` with GPU UUID `uuid`; `None` when no
    /// key applies to it.
    pub fn lookup(&self, index: u32, uuid: Option<&str>) -> Option<Resolved<'_, T>> {
        self.entries
            .iter()
            .find(|e| e.device.matches(index, uuid))
            .map(|e| Resolved {
                limit: e.limit,
                source: &e.source,
            })
    }

    /// True when no variable set a key (a key meaning "unlimited" counts as set).
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// The limiter's configuration in local mode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LimiterConfig {
    pub pod: PodId,
    /// Bytes.
    pub memory: DeviceLimits<u64>,
    pub compute: DeviceLimits<ComputeLimit>,
    /// Address of the node hypervisor, e.g. `http://127.0.0.1:8000`; `None`: local mode.
    pub hypervisor: Option<String>,
}

impl LimiterConfig {
    /// Reads the process environment (one pass over `std::env::vars_os`).
    ///
    /// Variables with non-UTF-8 names or values are skipped unless they are
    /// ones we read; a non-UTF-8 value of one we read is an error.
    pub fn from_env() -> Result<Self, ConfigError> {
        let mut raw = RawVars::default();
        for (name, value) in std::env::vars_os() {
            let Some(name) = name.to_str() else {
                continue;
            };
            raw.add(name, value.to_str().ok_or(value.as_os_str()))?;
        }
        raw.finish()
    }

    /// Reads the given variables as if they were the environment; for a name
    /// given twice, the last value wins.
    pub fn from_vars<I, K, V>(vars: I) -> Result<Self, ConfigError>
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<str>,
        V: AsRef<str>,
    {
        let mut raw = RawVars::default();
        for (name, value) in vars {
            raw.add(name.as_ref(), Ok(value.as_ref()))?;
        }
        raw.finish()
    }
}

/// Why a string is not a size; see [`parse_size`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeErrorKind {
    Empty,
    Invalid,
    Negative,
    Fractional,
    Overflow,
}

impl fmt::Display for SizeErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "is empty (expected {SIZE_SYNTAX})"),
            Self::Invalid => write!(f, "is not a size (expected {SIZE_SYNTAX})"),
            Self::Negative => write!(f, "is negative (expected {SIZE_SYNTAX})"),
            Self::Fractional => write!(f, "is not a whole number (expected {SIZE_SYNTAX})"),
            Self::Overflow => write!(f, "is too large (at most {} bytes)", u64::MAX),
        }
    }
}

/// A string that is not a size, e.g. `"4x" is not a size (expected …)`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{} {kind}", quoted(.input))]
pub struct SizeError {
    input: String,
    kind: SizeErrorKind,
}

impl SizeError {
    pub fn kind(&self) -> SizeErrorKind {
        self.kind
    }

    /// The string as given.
    pub fn input(&self) -> &str {
        &self.input
    }
}

/// Binary units, matched case-insensitively; the number is the power of 1024.
const UNITS: [(&str, u32); 18] = [
    ("", 0),
    ("b", 0),
    ("k", 1),
    ("kb", 1),
    ("ki", 1),
    ("kib", 1),
    ("m", 2),
    ("mb", 2),
    ("mi", 2),
    ("mib", 2),
    ("g", 3),
    ("gb", 3),
    ("gi", 3),
    ("gib", 3),
    ("t", 4),
    ("tb", 4),
    ("ti", 4),
    ("tib", 4),
];

/// Parses a size in bytes: a whole number, optionally followed by a binary
/// unit (`k`, `m`, `g`, `t`, also written `kb`/`kib`/`ki` and so on, any case;
/// `b` for bytes), with optional surrounding whitespace.
///
/// `"4g"` is 4 GiB, `"1024m"` 1 GiB, `"1048576"` 1 MiB.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let fail = |kind| {
        Err(SizeError {
            input: s.to_owned(),
            kind,
        })
    };
    let t = s.trim();
    if t.is_empty() {
        return fail(SizeErrorKind::Empty);
    }
    let digits = t.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = t.split_at(digits);
    let starts_numeric = |r: &str| r.starts_with(|c: char| c.is_ascii_digit() || c == '.');
    if number.is_empty() {
        return match t.strip_prefix('-') {
            Some(rest) if starts_numeric(rest) => fail(SizeErrorKind::Negative),
            _ if t.starts_with('.') && starts_numeric(&t[1..]) => fail(SizeErrorKind::Fractional),
            _ => fail(SizeErrorKind::Invalid),
        };
    }
    if unit.starts_with('.') {
        return fail(SizeErrorKind::Fractional);
    }
    let Some(&(_, power)) = UNITS.iter().find(|(u, _)| u.eq_ignore_ascii_case(unit)) else {
        return fail(SizeErrorKind::Invalid);
    };
    // All ASCII digits, so parsing can only fail by overflow.
    let Ok(n) = number.parse::<u64>() else {
        return fail(SizeErrorKind::Overflow);
    };
    match n.checked_mul(1u64 << (10 * power)) {
        Some(bytes) => Ok(bytes),
        None => fail(SizeErrorKind::Overflow),
    }
}

/// A configuration error. Every message is one line naming the variable, the
/// value and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    #[error("{var}={} is not valid UTF-8", quoted(.lossy))]
    NotUnicode { var: String, lossy: String },

    #[error(
        "{var}={} has device suffix {suffix:?}, which is not a device index (expected {base}_<i> with i from 0 to {})",
        quoted(.value),
        MAX_DEVICES - 1
    )]
    BadSuffix {
        var: String,
        value: String,
        base: &'static str,
        suffix: String,
    },

    #[error(
        "{var}={} names device {index}, but device indices go from 0 to {}",
        quoted(.value),
        MAX_DEVICES - 1
    )]
    IndexOutOfRange {
        var: String,
        value: String,
        index: String,
    },

    /// `var` may name a JSON key: `TENSOR_FUSION_CUDA_MEM_LIMIT["0"]`.
    #[error("{var}={error}")]
    Size { var: String, error: SizeError },

    #[error("{var}={} is not a percent (expected {PERCENT_SYNTAX})", quoted(.value))]
    Percent { var: String, value: String },

    #[error("{var}={} is not a policy (expected fixed, elastic or none)", quoted(.value))]
    Policy { var: String, value: String },

    #[error(
        "{soft_var}=\"{soft}\" is below {hard_var}=\"{hard}\" (expected a soft limit, the elastic ceiling, of at least the limit)"
    )]
    SoftBelowHard {
        soft_var: String,
        soft: u8,
        hard_var: String,
        hard: u8,
    },

    #[error("{var}={} has no limit to apply to (expected {needs} to be set too)", quoted(.value))]
    NoLimit {
        var: String,
        value: String,
        needs: String,
    },

    #[error("{var}={} is not a JSON object ({reason}; expected e.g. {example})", quoted(.value))]
    JsonNotObject {
        var: String,
        value: String,
        reason: String,
        example: &'static str,
    },

    #[error("{var} has key {key:?}, which is not {JSON_KEY_SYNTAX}")]
    JsonKey { var: String, key: String },

    #[error("{var} has {key:?}: {value}, which is not {expected}")]
    JsonValue {
        var: String,
        key: String,
        /// The JSON value, as compact JSON text.
        value: String,
        expected: &'static str,
    },

    #[error(
        "{var} names one device twice, as {first:?} and {second:?} (expected each device once)"
    )]
    JsonDuplicate {
        var: String,
        first: String,
        second: String,
    },

    #[error("CUDA_LIMITER_POD={}", .error)]
    Pod { error: InvalidPodId },

    #[error(
        "CUDA_LIMITER_HYPERVISOR={} is empty (expected an address such as http://127.0.0.1:8000, or leave it unset for local mode)",
        quoted(.value)
    )]
    Hypervisor { value: String },
}

/// Shows a user's value in one line: `"4x"`, `'{"0": 1}'` when it holds double
/// quotes, escaped when it holds control characters.
struct Quoted<'a>(&'a str);

fn quoted(s: &str) -> Quoted<'_> {
    Quoted(s)
}

impl fmt::Display for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        let plain = !s.chars().any(char::is_control);
        if plain && !s.contains('"') {
            write!(f, "\"{s}\"")
        } else if plain && !s.contains('\'') {
            write!(f, "'{s}'")
        } else {
            write!(f, "{s:?}")
        }
    }
}

// ---------------------------------------------------------------------------
// Reading: first collect the variables we know (last value of a name wins),
// then parse them in a fixed order so the error reported does not depend on
// the order of the environment.

/// What a variable sets. The order is the parse order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    MemOurs,
    MemHami,
    MemLegacy,
    MemTf,
    MemVcuda,
    SmOurs,
    SmPolicy,
    SmSoft,
    SmHami,
    CoreLimit,
    CoreSoft,
    UpTf,
    Pod,
    Hypervisor,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Scope {
    All,
    Index(u32),
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Scopes {
    AllOnly,
    IndexOnly,
    Both,
}

/// Our variables, and foreign ones we read: name, what it sets, which scopes.
/// Ours (`CUDA_LIMITER_*`) treat a non-index suffix as an error rather than as
/// someone else's variable.
const RULES: [(&str, Kind, Scopes); 14] = [
    ("CUDA_LIMITER_MEMORY_LIMIT", Kind::MemOurs, Scopes::Both),
    ("CUDA_DEVICE_MEMORY_LIMIT", Kind::MemHami, Scopes::Both),
    ("CUDA_MEM_LIMIT", Kind::MemLegacy, Scopes::IndexOnly),
    ("TENSOR_FUSION_CUDA_MEM_LIMIT", Kind::MemTf, Scopes::AllOnly),
    ("VCUDA_MEMORY_LIMIT", Kind::MemVcuda, Scopes::AllOnly),
    ("CUDA_LIMITER_SM_LIMIT", Kind::SmOurs, Scopes::Both),
    ("CUDA_LIMITER_SM_POLICY", Kind::SmPolicy, Scopes::Both),
    ("CUDA_LIMITER_SM_SOFT_LIMIT", Kind::SmSoft, Scopes::Both),
    ("CUDA_DEVICE_SM_LIMIT", Kind::SmHami, Scopes::Both),
    ("CUDA_CORE_LIMIT", Kind::CoreLimit, Scopes::IndexOnly),
    ("CUDA_CORE_SOFT_LIMIT", Kind::CoreSoft, Scopes::IndexOnly),
    ("TENSOR_FUSION_CUDA_UP_LIMIT", Kind::UpTf, Scopes::AllOnly),
    ("CUDA_LIMITER_POD", Kind::Pod, Scopes::AllOnly),
    ("CUDA_LIMITER_HYPERVISOR", Kind::Hypervisor, Scopes::AllOnly),
];

/// Precedence ranks, lower wins; every per-device rank is below every
/// all-devices rank.
mod rank {
    pub const OURS_INDEX: u8 = 0;
    pub const HAMI_INDEX: u8 = 1;
    pub const LEGACY_INDEX: u8 = 2;
    pub const TF_UUID: u8 = 3;
    pub const TF_INDEX: u8 = 4;
    pub const OURS_ALL: u8 = 5;
    pub const HAMI_ALL: u8 = 6;
    pub const VCUDA_ALL: u8 = 7;
}

enum Suffix {
    Index(u32),
    OutOfRange,
    NotIndex,
}

/// A canonical decimal index below `MAX_DEVICES` (no sign, no leading zero).
fn parse_index(s: &str) -> Suffix {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return Suffix::NotIndex;
    }
    match s.parse::<u32>() {
        Ok(i) if (i as usize) < MAX_DEVICES => Suffix::Index(i),
        _ => Suffix::OutOfRange,
    }
}

enum NameProblem {
    BadSuffix { base: &'static str, suffix: String },
    OutOfRange { index: String },
}

/// Which of our variables `name` is; `Ok(None)` for everything else.
fn classify(name: &str) -> Result<Option<(Kind, Scope)>, NameProblem> {
    // Nearly every variable of every process leaves here.
    if !(name.starts_with("CUDA_")
        || name.starts_with("TENSOR_FUSION_")
        || name.starts_with("VCUDA_"))
    {
        return Ok(None);
    }
    for &(base, kind, scopes) in &RULES {
        if name == base {
            return Ok((scopes != Scopes::IndexOnly).then_some((kind, Scope::All)));
        }
        let Some(suffix) = name
            .strip_prefix(base)
            .and_then(|rest| rest.strip_prefix('_'))
        else {
            continue;
        };
        if scopes == Scopes::AllOnly {
            // e.g. CUDA_LIMITER_POD_NAME: not ours, not a typo worth failing on.
            return Ok(None);
        }
        let ours = base.starts_with("CUDA_LIMITER_");
        return match parse_index(suffix) {
            Suffix::Index(i) => Ok(Some((kind, Scope::Index(i)))),
            Suffix::OutOfRange => Err(NameProblem::OutOfRange {
                index: suffix.to_owned(),
            }),
            Suffix::NotIndex if ours || suffix.starts_with(|c: char| c.is_ascii_digit()) => {
                Err(NameProblem::BadSuffix {
                    base,
                    suffix: suffix.to_owned(),
                })
            }
            Suffix::NotIndex => Ok(None),
        };
    }
    Ok(None)
}

struct RawVar {
    kind: Kind,
    scope: Scope,
    name: String,
    value: String,
}

#[derive(Default)]
struct RawVars {
    vars: Vec<RawVar>,
}

impl RawVars {
    fn add(&mut self, name: &str, value: Result<&str, &OsStr>) -> Result<(), ConfigError> {
        let (kind, scope) = match classify(name) {
            Ok(Some(found)) => found,
            Ok(None) => return Ok(()),
            Err(problem) => {
                // The name itself is wrong here; keep the message on one line.
                let var = if name.contains(char::is_control) {
                    name.escape_debug().to_string()
                } else {
                    name.to_owned()
                };
                let value = match value {
                    Ok(v) => v.to_owned(),
                    Err(os) => os.to_string_lossy().into_owned(),
                };
                return Err(match problem {
                    NameProblem::BadSuffix { base, suffix } => ConfigError::BadSuffix {
                        var,
                        value,
                        base,
                        suffix,
                    },
                    NameProblem::OutOfRange { index } => {
                        ConfigError::IndexOutOfRange { var, value, index }
                    }
                });
            }
        };
        let value = value.map_err(|os| ConfigError::NotUnicode {
            var: name.to_owned(),
            lossy: os.to_string_lossy().into_owned(),
        })?;
        let var = RawVar {
            kind,
            scope,
            name: name.to_owned(),
            value: value.to_owned(),
        };
        match self
            .vars
            .iter_mut()
            .find(|v| v.kind == kind && v.scope == scope)
        {
            Some(old) => *old = var,
            None => self.vars.push(var),
        }
        Ok(())
    }

    fn finish(mut self) -> Result<LimiterConfig, ConfigError> {
        self.vars.sort_by_key(|v| (v.kind, v.scope));
        let mut config = LimiterConfig::default();
        let mut sm = OursSm::default();
        let mut core: [CorePair<'_>; MAX_DEVICES] = Default::default();
        for v in &self.vars {
            let device = match v.scope {
                Scope::All => Device::All,
                Scope::Index(i) => Device::Index(i),
            };
            let per_device = v.scope != Scope::All;
            match v.kind {
                Kind::MemOurs | Kind::MemHami | Kind::MemLegacy | Kind::MemVcuda => {
                    let bytes = parse_size(&v.value).map_err(|error| ConfigError::Size {
                        var: v.name.clone(),
                        error,
                    })?;
                    let rank = match (v.kind, per_device) {
                        (Kind::MemOurs, true) => rank::OURS_INDEX,
                        (Kind::MemOurs, false) => rank::OURS_ALL,
                        (Kind::MemHami, true) => rank::HAMI_INDEX,
                        (Kind::MemHami, false) => rank::HAMI_ALL,
                        (Kind::MemLegacy, _) => rank::LEGACY_INDEX,
                        _ => rank::VCUDA_ALL,
                    };
                    let limit = (bytes != 0).then_some(bytes);
                    config.memory.push(rank, device, limit, v.name.clone());
                }
                Kind::MemTf => {
                    parse_json_limits(v, &mut config.memory, MEM_JSON_EXAMPLE, json_bytes)?;
                }
                Kind::SmOurs => sm.slot(v.scope).limit = Some(Val::new(v, percent(v)?)),
                Kind::SmPolicy => {
                    let policy =
                        ComputePolicy::parse(&v.value).ok_or_else(|| ConfigError::Policy {
                            var: v.name.clone(),
                            value: v.value.clone(),
                        })?;
                    sm.slot(v.scope).policy = Some(Val::new(v, policy));
                }
                Kind::SmSoft => sm.slot(v.scope).soft = Some(Val::new(v, percent(v)?)),
                Kind::SmHami => {
                    let rank = if per_device {
                        rank::HAMI_INDEX
                    } else {
                        rank::HAMI_ALL
                    };
                    let limit = limited(percent(v)?).map(ComputeLimit::fixed);
                    config.compute.push(rank, device, limit, v.name.clone());
                }
                Kind::CoreLimit | Kind::CoreSoft => {
                    if let Scope::Index(i) = v.scope
                        && let Some(pair) = core.get_mut(i as usize)
                    {
                        let val = Some(Val::new(v, percent(v)?));
                        if v.kind == Kind::CoreLimit {
                            pair.hard = val;
                        } else {
                            pair.soft = val;
                        }
                    }
                }
                Kind::UpTf => {
                    parse_json_limits(v, &mut config.compute, UP_JSON_EXAMPLE, json_percent)?;
                }
                Kind::Pod => {
                    config.pod =
                        PodId::new(v.value.trim()).map_err(|error| ConfigError::Pod { error })?;
                }
                Kind::Hypervisor => {
                    let address = v.value.trim();
                    if address.is_empty() {
                        return Err(ConfigError::Hypervisor {
                            value: v.value.clone(),
                        });
                    }
                    config.hypervisor = Some(address.to_owned());
                }
            }
        }
        sm.push_to(&mut config.compute)?;
        for (i, pair) in (0u32..).zip(&core) {
            if let Some((limit, source)) = pair.resolve(i)? {
                let source = source.to_owned();
                config
                    .compute
                    .push(rank::LEGACY_INDEX, Device::Index(i), limit, source);
            }
        }
        Ok(config)
    }
}

/// A parsed value with the variable it came from, for error messages.
#[derive(Clone, Copy)]
struct Val<'a, T> {
    name: &'a str,
    raw: &'a str,
    parsed: T,
}

impl<'a, T> Val<'a, T> {
    fn new(var: &'a RawVar, parsed: T) -> Self {
        Self {
            name: &var.name,
            raw: &var.value,
            parsed,
        }
    }
}

fn percent(v: &RawVar) -> Result<u8, ConfigError> {
    parse_percent(&v.value).ok_or_else(|| ConfigError::Percent {
        var: v.name.clone(),
        value: v.value.clone(),
    })
}

/// A whole number from 0 to 100, optional trailing `%`, surrounding whitespace allowed.
fn parse_percent(s: &str) -> Option<u8> {
    let t = s.trim();
    let t = t.strip_suffix('%').unwrap_or(t);
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    t.parse::<u8>().ok().filter(|p| *p <= 100)
}

/// `None` for 0 and 100, which mean unlimited.
fn limited(percent: u8) -> Option<u8> {
    (1..100).contains(&percent).then_some(percent)
}

/// The elastic ceiling as stored: 100 means the whole device.
fn ceiling(soft: u8) -> Option<u8> {
    (soft < 100).then_some(soft)
}

#[derive(Default, Clone, Copy)]
struct SmTriple<'a> {
    limit: Option<Val<'a, u8>>,
    policy: Option<Val<'a, ComputePolicy>>,
    soft: Option<Val<'a, u8>>,
}

impl SmTriple<'_> {
    fn is_empty(&self) -> bool {
        self.limit.is_none() && self.policy.is_none() && self.soft.is_none()
    }
}

/// `CUDA_LIMITER_SM_{LIMIT,POLICY,SOFT_LIMIT}[_<i>]`.
#[derive(Default)]
struct OursSm<'a> {
    all: SmTriple<'a>,
    per: [SmTriple<'a>; MAX_DEVICES],
}

impl<'a> OursSm<'a> {
    fn slot(&mut self, scope: Scope) -> &mut SmTriple<'a> {
        match scope {
            Scope::Index(i) if (i as usize) < MAX_DEVICES => &mut self.per[i as usize],
            // classify() only makes indices below MAX_DEVICES.
            _ => &mut self.all,
        }
    }

    fn push_to(&self, out: &mut DeviceLimits<ComputeLimit>) -> Result<(), ConfigError> {
        let all = self.all;
        let mut any_per_device = false;
        for (i, own) in (0u32..).zip(&self.per) {
            if own.is_empty() {
                continue;
            }
            any_per_device = true;
            let merged = SmTriple {
                limit: own.limit.or(all.limit),
                policy: own.policy.or(all.policy),
                soft: own.soft.or(all.soft),
            };
            let source = [own.limit.map(|v| v.name), own.policy.map(|v| v.name)]
                .into_iter()
                .flatten()
                .chain(own.soft.map(|v| v.name))
                .next()
                .unwrap_or_default();
            let needs = || format!("CUDA_LIMITER_SM_LIMIT_{i} or CUDA_LIMITER_SM_LIMIT");
            let limit = combine(merged, own, needs)?;
            out.push(rank::OURS_INDEX, Device::Index(i), limit, source.to_owned());
        }
        let policy_none = all.policy.is_some_and(|p| p.parsed == ComputePolicy::None);
        if all.limit.is_some() || policy_none {
            let source = all
                .limit
                .or(all.soft)
                .map_or("CUDA_LIMITER_SM_POLICY", |v| v.name);
            let needs = || "CUDA_LIMITER_SM_LIMIT".to_owned();
            let limit = combine(all, &all, needs)?;
            out.push(rank::OURS_ALL, Device::All, limit, source.to_owned());
        } else if !any_per_device {
            // A policy or soft limit is a default for our limits; with none, it
            // would silently do nothing.
            let stray = all
                .policy
                .map(|v| (v.name, v.raw))
                .or(all.soft.map(|v| (v.name, v.raw)));
            if let Some((var, value)) = stray {
                return Err(ConfigError::NoLimit {
                    var: var.to_owned(),
                    value: value.to_owned(),
                    needs: "CUDA_LIMITER_SM_LIMIT or CUDA_LIMITER_SM_LIMIT_<i>".to_owned(),
                });
            }
        }
        Ok(())
    }
}

/// One key's compute limit from its limit, policy and soft limit; `own` holds
/// the variables of the key itself, to name in a missing-limit error.
fn combine(
    merged: SmTriple<'_>,
    own: &SmTriple<'_>,
    needs: impl FnOnce() -> String,
) -> Result<Option<ComputeLimit>, ConfigError> {
    let policy = merged.policy.map(|p| p.parsed);
    if policy == Some(ComputePolicy::None) {
        return Ok(None);
    }
    let Some(limit) = merged.limit else {
        let (var, value) = own
            .policy
            .map(|v| (v.name, v.raw))
            .or(own.soft.map(|v| (v.name, v.raw)))
            .unwrap_or_default();
        return Err(ConfigError::NoLimit {
            var: var.to_owned(),
            value: value.to_owned(),
            needs: needs(),
        });
    };
    let Some(hard) = limited(limit.parsed) else {
        return Ok(None);
    };
    if policy == Some(ComputePolicy::Fixed) {
        return Ok(Some(ComputeLimit::fixed(hard)));
    }
    let soft = match merged.soft {
        Some(s) if s.parsed < hard => {
            return Err(ConfigError::SoftBelowHard {
                soft_var: s.name.to_owned(),
                soft: s.parsed,
                hard_var: limit.name.to_owned(),
                hard,
            });
        }
        Some(s) => Some(s.parsed),
        None => None,
    };
    let elastic = policy == Some(ComputePolicy::Elastic) || soft.is_some_and(|s| s > hard);
    Ok(Some(if elastic {
        ComputeLimit {
            percent: hard,
            policy: ComputePolicy::Elastic,
            soft_percent: soft.and_then(ceiling),
        }
    } else {
        ComputeLimit::fixed(hard)
    }))
}

/// A key's limit (`None`: unlimited) and the variable it came from.
type SourcedLimit<'a> = (Option<ComputeLimit>, &'a str);

/// `CUDA_CORE_LIMIT_<i>` and `CUDA_CORE_SOFT_LIMIT_<i>`.
#[derive(Default)]
struct CorePair<'a> {
    hard: Option<Val<'a, u8>>,
    soft: Option<Val<'a, u8>>,
}

impl<'a> CorePair<'a> {
    /// The key for device `i`, with its source variable; `None` when unset.
    fn resolve(&self, i: u32) -> Result<Option<SourcedLimit<'a>>, ConfigError> {
        let Some(hard) = self.hard else {
            return match self.soft {
                Some(s) => Err(ConfigError::NoLimit {
                    var: s.name.to_owned(),
                    value: s.raw.to_owned(),
                    needs: format!("CUDA_CORE_LIMIT_{i}"),
                }),
                None => Ok(None),
            };
        };
        let Some(percent) = limited(hard.parsed) else {
            return Ok(Some((None, hard.name)));
        };
        let limit = match self.soft {
            Some(s) if s.parsed < percent => {
                return Err(ConfigError::SoftBelowHard {
                    soft_var: s.name.to_owned(),
                    soft: s.parsed,
                    hard_var: hard.name.to_owned(),
                    hard: percent,
                });
            }
            Some(s) if s.parsed > percent => ComputeLimit {
                percent,
                policy: ComputePolicy::Elastic,
                soft_percent: ceiling(s.parsed),
            },
            _ => ComputeLimit::fixed(percent),
        };
        Ok(Some((Some(limit), hard.name)))
    }
}

/// One JSON value of a TensorFusion map; `Ok(None)` means unlimited.
type JsonValueParser<T> = fn(&str, &str, &serde_json::Value) -> Result<Option<T>, ConfigError>;

fn json_bytes(var: &str, key: &str, value: &serde_json::Value) -> Result<Option<u64>, ConfigError> {
    let bytes = match value {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => Some(parse_size(s).map_err(|error| ConfigError::Size {
            var: format!("{var}[{key:?}]"),
            error,
        })?),
        _ => None,
    };
    match bytes {
        Some(b) => Ok((b != 0).then_some(b)),
        None => Err(json_value_error(var, key, value, MEM_JSON_VALUE)),
    }
}

fn json_percent(
    var: &str,
    key: &str,
    value: &serde_json::Value,
) -> Result<Option<ComputeLimit>, ConfigError> {
    match value.as_u64().filter(|p| *p <= 100) {
        Some(p) => Ok(u8::try_from(p)
            .ok()
            .and_then(limited)
            .map(ComputeLimit::fixed)),
        None => Err(json_value_error(var, key, value, UP_JSON_VALUE)),
    }
}

fn json_value_error(
    var: &str,
    key: &str,
    value: &serde_json::Value,
    expected: &'static str,
) -> ConfigError {
    ConfigError::JsonValue {
        var: var.to_owned(),
        key: key.to_owned(),
        value: value.to_string(),
        expected,
    }
}

/// A TensorFusion map key: a device index or a GPU/MIG UUID (lowercased).
fn json_device(key: &str) -> Option<Device> {
    match parse_index(key) {
        Suffix::Index(i) => return Some(Device::Index(i)),
        Suffix::OutOfRange => return None,
        Suffix::NotIndex => {}
    }
    let prefix = key.get(..4)?;
    let is_uuid = (prefix.eq_ignore_ascii_case("gpu-") || prefix.eq_ignore_ascii_case("mig-"))
        && key.len() > 4
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/');
    is_uuid.then(|| Device::Uuid(key.to_ascii_lowercase()))
}

fn parse_json_limits<T>(
    v: &RawVar,
    out: &mut DeviceLimits<T>,
    example: &'static str,
    parse_value: JsonValueParser<T>,
) -> Result<(), ConfigError> {
    let not_object = |reason: String| ConfigError::JsonNotObject {
        var: v.name.clone(),
        value: v.value.clone(),
        reason,
        example,
    };
    let json: serde_json::Value =
        serde_json::from_str(&v.value).map_err(|e| not_object(e.to_string()))?;
    let found = match json {
        serde_json::Value::Object(map) => map,
        serde_json::Value::Null => return Err(not_object("found null".to_owned())),
        serde_json::Value::Bool(_) => return Err(not_object("found a boolean".to_owned())),
        serde_json::Value::Number(_) => return Err(not_object("found a number".to_owned())),
        serde_json::Value::String(_) => return Err(not_object("found a string".to_owned())),
        serde_json::Value::Array(_) => return Err(not_object("found an array".to_owned())),
    };
    let map = found;
    let mut seen: Vec<(Device, &str)> = Vec::with_capacity(map.len());
    for (key, value) in &map {
        let Some(device) = json_device(key) else {
            return Err(ConfigError::JsonKey {
                var: v.name.clone(),
                key: key.clone(),
            });
        };
        if let Some((_, first)) = seen.iter().find(|(d, _)| *d == device) {
            return Err(ConfigError::JsonDuplicate {
                var: v.name.clone(),
                first: (*first).to_owned(),
                second: key.clone(),
            });
        }
        let limit = parse_value(&v.name, key, value)?;
        let rank = match device {
            Device::Uuid(_) => rank::TF_UUID,
            _ => rank::TF_INDEX,
        };
        out.push(rank, device.clone(), limit, format!("{}[{key:?}]", v.name));
        seen.push((device, key.as_str()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;
    const MIB: u64 = 1 << 20;
    const UUID: &str = "GPU-3430f778-7a25-704c-9090-8b0bb2478114";

    fn cfg(vars: &[(&str, &str)]) -> Result<LimiterConfig, ConfigError> {
        LimiterConfig::from_vars(vars.iter().copied())
    }

    fn ok(vars: &[(&str, &str)]) -> LimiterConfig {
        match cfg(vars) {
            Ok(c) => c,
            Err(e) => panic!("{vars:?}: unexpected error: {e}"),
        }
    }

    fn err(vars: &[(&str, &str)]) -> ConfigError {
        match cfg(vars) {
            Ok(c) => panic!("{vars:?}: expected an error, got {c:?}"),
            Err(e) => e,
        }
    }

    /// Variables separated by `|`, e.g. `"~SM_LIMIT=30|CUDA_CORE_LIMIT_0=50"`;
    /// a leading `~` stands for `CUDA_LIMITER_`. Values are kept verbatim.
    fn env(spec: &str) -> Vec<(String, String)> {
        spec.split('|')
            .filter(|kv| !kv.is_empty())
            .map(|kv| {
                let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
                let k = match k.strip_prefix('~') {
                    Some(rest) => format!("CUDA_LIMITER_{rest}"),
                    None => k.to_owned(),
                };
                (k, v.to_owned())
            })
            .collect()
    }

    fn ok_spec(spec: &str) -> LimiterConfig {
        match LimiterConfig::from_vars(env(spec)) {
            Ok(c) => c,
            Err(e) => panic!("{spec}: unexpected error: {e}"),
        }
    }

    fn err_spec(spec: &str) -> ConfigError {
        match LimiterConfig::from_vars(env(spec)) {
            Ok(c) => panic!("{spec}: expected an error, got {c:?}"),
            Err(e) => e,
        }
    }

    fn elastic(percent: u8, soft_percent: Option<u8>) -> ComputeLimit {
        ComputeLimit {
            percent,
            policy: ComputePolicy::Elastic,
            soft_percent,
        }
    }

    #[test]
    fn sizes_accepted() {
        let table: &[(&str, u64)] = &[
            ("0", 0),
            ("1", 1),
            ("1048576", MIB),
            ("18446744073709551615", u64::MAX),
            ("007", 7),
            ("  4g  ", 4 * GIB),
            ("\t4g\n", 4 * GIB),
            ("4g", 4 * GIB),
            ("4G", 4 * GIB),
            ("4gb", 4 * GIB),
            ("4GB", 4 * GIB),
            ("4gib", 4 * GIB),
            ("4GiB", 4 * GIB),
            ("4Gi", 4 * GIB),
            ("1024m", GIB),
            ("1024M", GIB),
            ("1024mb", GIB),
            ("1024MiB", GIB),
            ("1024mi", GIB),
            ("1048576k", GIB),
            ("1048576K", GIB),
            ("1048576kb", GIB),
            ("1048576KiB", GIB),
            ("1048576ki", GIB),
            ("2t", 2 << 40),
            ("2T", 2 << 40),
            ("2tb", 2 << 40),
            ("2TiB", 2 << 40),
            ("2ti", 2 << 40),
            ("512b", 512),
            ("512B", 512),
            ("0g", 0),
            ("16777215t", 16_777_215 << 40),
        ];
        for &(input, want) in table {
            assert_eq!(parse_size(input), Ok(want), "{input:?}");
        }
    }

    #[test]
    fn sizes_rejected() {
        use SizeErrorKind::*;
        let table: &[(&str, SizeErrorKind)] = &[
            ("", Empty),
            ("   ", Empty),
            ("4x", Invalid),
            ("g", Invalid),
            ("4 g", Invalid),
            ("4gg", Invalid),
            ("4p", Invalid),
            ("+4g", Invalid),
            ("0x10", Invalid),
            ("1e9", Invalid),
            ("4g4", Invalid),
            ("four", Invalid),
            ("-", Invalid),
            ("４g", Invalid),
            ("-1", Negative),
            ("-4g", Negative),
            ("-0.5g", Negative),
            ("1.5g", Fractional),
            ("1.0", Fractional),
            ("1.", Fractional),
            (".5g", Fractional),
            ("18446744073709551616", Overflow),
            ("99999999999999999999999", Overflow),
            ("16777216t", Overflow),
            ("17179869184g", Overflow),
        ];
        for &(input, kind) in table {
            match parse_size(input) {
                Ok(v) => panic!("{input:?} parsed as {v}"),
                Err(e) => {
                    assert_eq!(e.kind(), kind, "{input:?}");
                    assert_eq!(e.input(), input);
                }
            }
        }
    }

    #[test]
    fn size_error_text() {
        let table: &[(&str, &str)] = &[
            (
                "4x",
                "\"4x\" is not a size (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "",
                "\"\" is empty (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "-1g",
                "\"-1g\" is negative (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "1.5g",
                "\"1.5g\" is not a whole number (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)",
            ),
            (
                "99999999999999999999",
                "\"99999999999999999999\" is too large (at most 18446744073709551615 bytes)",
            ),
        ];
        for &(input, want) in table {
            let e = parse_size(input).err().map(|e| e.to_string());
            assert_eq!(e.as_deref(), Some(want), "{input:?}");
        }
    }

    #[test]
    fn error_text_matches_the_contract() {
        let e = err(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "4x")]);
        assert_eq!(
            e.to_string(),
            "CUDA_DEVICE_MEMORY_LIMIT_0=\"4x\" is not a size (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)"
        );
    }

    #[test]
    fn every_memory_variable() {
        // (name, value, device, UUID, want)
        type Row<'a> = (&'a str, &'a str, u32, Option<&'a str>, Option<u64>);
        let table: &[Row] = &[
            ("CUDA_LIMITER_MEMORY_LIMIT", "4g", 3, None, Some(4 * GIB)),
            ("CUDA_LIMITER_MEMORY_LIMIT_2", "4g", 2, None, Some(4 * GIB)),
            ("CUDA_LIMITER_MEMORY_LIMIT_2", "4g", 1, None, None),
            ("CUDA_LIMITER_MEMORY_LIMIT_15", "1m", 15, None, Some(MIB)),
            ("CUDA_DEVICE_MEMORY_LIMIT", "1024m", 0, None, Some(GIB)),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1048576k", 1, None, Some(GIB)),
            ("CUDA_DEVICE_MEMORY_LIMIT_1", "1048576k", 0, None, None),
            ("CUDA_MEM_LIMIT_0", "2g", 0, None, Some(2 * GIB)),
            ("CUDA_MEM_LIMIT_0", "2g", 1, None, None),
            ("VCUDA_MEMORY_LIMIT", "1073741824", 5, None, Some(GIB)),
            ("VCUDA_MEMORY_LIMIT", "3g", 5, None, Some(3 * GIB)),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"gpu-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824}"#,
                7,
                Some(UUID),
                Some(GIB),
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"gpu-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824}"#,
                7,
                None,
                None,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 2147483648}"#,
                0,
                None,
                Some(2 * GIB),
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 2147483648}"#,
                1,
                None,
                None,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"1": "4g"}"#,
                1,
                None,
                Some(4 * GIB),
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#" { "1" : " 4G " } "#,
                1,
                None,
                Some(4 * GIB),
            ),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", "{}", 0, Some(UUID), None),
        ];
        for &(name, value, index, uuid, want) in table {
            let c = ok(&[(name, value)]);
            assert_eq!(
                c.memory.resolve(index, uuid),
                want,
                "{name}={value} device {index}"
            );
            assert!(c.compute.is_empty(), "{name}");
        }
        assert!(
            ok(&[("TENSOR_FUSION_CUDA_MEM_LIMIT", "{}")])
                .memory
                .is_empty()
        );
    }

    #[test]
    fn memory_precedence() {
        // Each row: the variables set, then the variable expected to win for
        // device 0 with UUID `UUID`.
        let all_keys: [(&str, &str); 8] = [
            ("CUDA_LIMITER_MEMORY_LIMIT_0", "1m"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "2m"),
            ("CUDA_MEM_LIMIT_0", "3m"),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"GPU-3430F778-7A25-704C-9090-8B0BB2478114": 4194304, "0": 5242880}"#,
            ),
            ("CUDA_LIMITER_MEMORY_LIMIT", "6m"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "7m"),
            ("VCUDA_MEMORY_LIMIT", "8m"),
            ("UNRELATED", "9m"),
        ];
        // Dropping the winners one by one walks down the precedence list.
        let winners = [1, 2, 3, 4, 6, 7, 8];
        for skip in 0..all_keys.len() {
            let vars = &all_keys[skip..];
            let c = ok(vars);
            let want = winners.get(skip).map(|m| m * MIB);
            let got = c.memory.resolve(0, Some(UUID));
            assert_eq!(got, want, "top key {:?}", vars[0]);
        }
        // TensorFusion by index is below by UUID, above all-devices keys.
        let c = ok(&[
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", r#"{"0": 5242880}"#),
            ("CUDA_LIMITER_MEMORY_LIMIT", "6m"),
        ]);
        assert_eq!(c.memory.resolve(0, Some(UUID)), Some(5 * MIB));
        assert_eq!(c.memory.resolve(1, Some(UUID)), Some(6 * MIB));
        // The source names the deciding variable.
        let c = ok(&all_keys[3..]);
        let r = c.memory.lookup(0, Some(UUID));
        assert_eq!(
            r.map(|r| r.source),
            Some("TENSOR_FUSION_CUDA_MEM_LIMIT[\"GPU-3430F778-7A25-704C-9090-8B0BB2478114\"]")
        );
        assert_eq!(
            c.memory.lookup(0, None).map(|r| r.limit),
            Some(Some(5 * MIB))
        );
        assert_eq!(
            c.memory.lookup(9, None).map(|r| r.source),
            Some("CUDA_LIMITER_MEMORY_LIMIT")
        );
    }

    #[test]
    fn uuids_are_case_insensitive() {
        let lower = r#"{"gpu-3430f778-7a25-704c-9090-8b0bb2478114": 1048576}"#;
        let upper = r#"{"GPU-3430F778-7A25-704C-9090-8B0BB2478114": 1048576}"#;
        let queries = [
            UUID,
            "gpu-3430f778-7a25-704c-9090-8b0bb2478114",
            "GPU-3430F778-7A25-704C-9090-8B0BB2478114",
        ];
        for json in [lower, upper] {
            let c = ok(&[("TENSOR_FUSION_CUDA_MEM_LIMIT", json)]);
            for q in queries {
                assert_eq!(c.memory.resolve(4, Some(q)), Some(MIB), "{json} {q}");
            }
            assert_eq!(c.memory.resolve(4, Some("GPU-other")), None);
        }
        let mig = r#"{"MIG-5c8e6d2a-1b3f-5f0e-8c9d-0a1b2c3d4e5f": 30}"#;
        let c = ok(&[("TENSOR_FUSION_CUDA_UP_LIMIT", mig)]);
        let got = c
            .compute
            .resolve(0, Some("mig-5C8E6D2A-1B3F-5F0E-8C9D-0A1B2C3D4E5F"));
        assert_eq!(got, Some(ComputeLimit::fixed(30)));
    }

    #[test]
    fn zero_is_unlimited_and_shadows() {
        // (variables, device, want resolve, want lookup source)
        let table: &[(&str, u32, Option<u64>, Option<&str>)] = &[
            (
                "~MEMORY_LIMIT=0",
                0,
                None,
                Some("CUDA_LIMITER_MEMORY_LIMIT"),
            ),
            (
                "~MEMORY_LIMIT_0=0|CUDA_DEVICE_MEMORY_LIMIT=4g",
                0,
                None,
                Some("CUDA_LIMITER_MEMORY_LIMIT_0"),
            ),
            (
                "~MEMORY_LIMIT_0=0|CUDA_DEVICE_MEMORY_LIMIT=4g",
                1,
                Some(4 * GIB),
                Some("CUDA_DEVICE_MEMORY_LIMIT"),
            ),
            (
                "~MEMORY_LIMIT=0g|VCUDA_MEMORY_LIMIT=4g",
                3,
                None,
                Some("CUDA_LIMITER_MEMORY_LIMIT"),
            ),
            (
                "CUDA_MEM_LIMIT_3=0|VCUDA_MEMORY_LIMIT=4g",
                3,
                None,
                Some("CUDA_MEM_LIMIT_3"),
            ),
            (
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT={"0": 0}|VCUDA_MEMORY_LIMIT=4g"#,
                0,
                None,
                Some(r#"TENSOR_FUSION_CUDA_MEM_LIMIT["0"]"#),
            ),
            (
                "VCUDA_MEMORY_LIMIT=4g",
                0,
                Some(4 * GIB),
                Some("VCUDA_MEMORY_LIMIT"),
            ),
            ("", 0, None, None),
        ];
        for &(spec, device, want, source) in table {
            let c = ok_spec(spec);
            assert_eq!(c.memory.resolve(device, None), want, "{spec}");
            let r = c.memory.lookup(device, None);
            assert_eq!(r.map(|r| r.source), source, "{spec}");
            assert_eq!(r.and_then(|r| r.limit), want, "{spec}");
        }
        assert!(
            !ok_spec("~MEMORY_LIMIT=0").memory.is_empty(),
            "an explicit 0 is a key"
        );
    }

    #[test]
    fn compute_variables_and_policies() {
        let fixed = |p| Some(ComputeLimit::fixed(p));
        let elastic = |p, soft| Some(elastic(p, soft));
        let table: &[(&str, u32, Option<ComputeLimit>)] = &[
            ("~SM_LIMIT=30", 4, fixed(30)),
            ("~SM_LIMIT= 30% ", 4, fixed(30)),
            ("~SM_LIMIT=0", 0, None),
            ("~SM_LIMIT=100", 0, None),
            ("~SM_LIMIT_1=20", 1, fixed(20)),
            ("~SM_LIMIT_1=20", 0, None),
            ("~SM_LIMIT=30|~SM_POLICY=fixed", 0, fixed(30)),
            ("~SM_LIMIT=30|~SM_POLICY=ELASTIC", 0, elastic(30, None)),
            ("~SM_LIMIT=30|~SM_POLICY= None ", 0, None),
            ("~SM_POLICY=none", 0, None),
            (
                "~SM_LIMIT=30|~SM_POLICY=elastic|~SM_SOFT_LIMIT=60",
                0,
                elastic(30, Some(60)),
            ),
            ("~SM_LIMIT=30|~SM_SOFT_LIMIT=60", 0, elastic(30, Some(60))),
            ("~SM_LIMIT=30|~SM_SOFT_LIMIT=100", 0, elastic(30, None)),
            ("~SM_LIMIT=30|~SM_SOFT_LIMIT=30", 0, fixed(30)),
            (
                "~SM_LIMIT=30|~SM_POLICY=elastic|~SM_SOFT_LIMIT=30",
                0,
                elastic(30, Some(30)),
            ),
            (
                "~SM_LIMIT=30|~SM_POLICY=fixed|~SM_SOFT_LIMIT=60",
                0,
                fixed(30),
            ),
            (
                "~SM_LIMIT=30|~SM_POLICY=fixed|~SM_SOFT_LIMIT=10",
                0,
                fixed(30),
            ),
            // Per-device policy over the all-devices limit.
            ("~SM_LIMIT=30|~SM_POLICY_1=elastic", 1, elastic(30, None)),
            ("~SM_LIMIT=30|~SM_POLICY_1=elastic", 0, fixed(30)),
            ("~SM_LIMIT=40|~SM_POLICY_3=none", 3, None),
            ("~SM_LIMIT=40|~SM_SOFT_LIMIT_3=90", 3, elastic(40, Some(90))),
            (
                "~SM_LIMIT=40|~SM_POLICY=elastic|~SM_POLICY_3=fixed",
                3,
                fixed(40),
            ),
            // All-devices policy and soft limit are defaults for per-device limits.
            (
                "~SM_POLICY=elastic|~SM_SOFT_LIMIT=80|~SM_LIMIT_2=40",
                2,
                elastic(40, Some(80)),
            ),
            ("~SM_POLICY=elastic|~SM_LIMIT_2=40", 1, None),
            ("~SM_POLICY=none|~SM_LIMIT_2=40", 2, None),
            // HAMi.
            ("CUDA_DEVICE_SM_LIMIT=25", 7, fixed(25)),
            ("CUDA_DEVICE_SM_LIMIT=100", 7, None),
            ("CUDA_DEVICE_SM_LIMIT_7=25", 7, fixed(25)),
            ("CUDA_DEVICE_SM_LIMIT_7=25", 6, None),
            ("CUDA_DEVICE_SM_LIMIT_7=0", 7, None),
            // CUDA_CORE_*.
            ("CUDA_CORE_LIMIT_0=50", 0, fixed(50)),
            ("CUDA_CORE_LIMIT_0=50", 1, None),
            (
                "CUDA_CORE_LIMIT_0=50|CUDA_CORE_SOFT_LIMIT_0=50",
                0,
                fixed(50),
            ),
            (
                "CUDA_CORE_LIMIT_0=50|CUDA_CORE_SOFT_LIMIT_0=70",
                0,
                elastic(50, Some(70)),
            ),
            (
                "CUDA_CORE_LIMIT_0=50|CUDA_CORE_SOFT_LIMIT_0=100",
                0,
                elastic(50, None),
            ),
            ("CUDA_CORE_LIMIT_0=0|CUDA_CORE_SOFT_LIMIT_0=20", 0, None),
            ("CUDA_CORE_LIMIT_0=100", 0, None),
            // TensorFusion.
            (r#"TENSOR_FUSION_CUDA_UP_LIMIT={"0": 30}"#, 0, fixed(30)),
            (r#"TENSOR_FUSION_CUDA_UP_LIMIT={"0": 100}"#, 0, None),
            (r#"TENSOR_FUSION_CUDA_UP_LIMIT={"0": 0}"#, 0, None),
            (
                r#"TENSOR_FUSION_CUDA_UP_LIMIT={"gpu-3430f778-7a25-704c-9090-8b0bb2478114": 45}"#,
                0,
                fixed(45),
            ),
            ("TENSOR_FUSION_CUDA_UP_LIMIT={}", 0, None),
        ];
        for &(spec, device, want) in table {
            let c = ok_spec(spec);
            assert_eq!(
                c.compute.resolve(device, Some(UUID)),
                want,
                "{spec} device {device}"
            );
            assert!(c.memory.is_empty(), "{spec}");
        }
    }

    #[test]
    fn compute_precedence() {
        let all_keys: [(&str, &str); 6] = [
            ("CUDA_LIMITER_SM_LIMIT_0", "11"),
            ("CUDA_DEVICE_SM_LIMIT_0", "12"),
            ("CUDA_CORE_LIMIT_0", "13"),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                r#"{"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 14, "0": 15}"#,
            ),
            ("CUDA_LIMITER_SM_LIMIT", "16"),
            ("CUDA_DEVICE_SM_LIMIT", "17"),
        ];
        // Dropping the winners one by one walks down the precedence list.
        let winners = [11, 12, 13, 14, 16, 17];
        for (skip, &percent) in winners.iter().enumerate() {
            let c = ok(&all_keys[skip..]);
            let want = ComputeLimit::fixed(percent);
            assert_eq!(
                c.compute.resolve(0, Some(UUID)),
                Some(want),
                "top {:?}",
                all_keys[skip]
            );
        }
        let c = ok(&[
            ("TENSOR_FUSION_CUDA_UP_LIMIT", r#"{"0": 15}"#),
            ("CUDA_DEVICE_SM_LIMIT", "17"),
        ]);
        assert_eq!(c.compute.resolve(0, None), Some(ComputeLimit::fixed(15)));
        assert_eq!(c.compute.resolve(1, None), Some(ComputeLimit::fixed(17)));
        // Unlimited per-device keys shadow all-devices limits.
        let c = ok(&[
            ("CUDA_LIMITER_SM_LIMIT_0", "0"),
            ("CUDA_DEVICE_SM_LIMIT", "17"),
        ]);
        assert_eq!(c.compute.resolve(0, None), None);
        assert_eq!(
            c.compute.lookup(0, None),
            Some(Resolved {
                limit: None,
                source: "CUDA_LIMITER_SM_LIMIT_0"
            })
        );
        assert_eq!(c.compute.resolve(1, None), Some(ComputeLimit::fixed(17)));
    }

    #[test]
    fn policy_parsing() {
        let table: &[(&str, Option<ComputePolicy>)] = &[
            ("fixed", Some(ComputePolicy::Fixed)),
            ("FIXED", Some(ComputePolicy::Fixed)),
            (" Fixed\n", Some(ComputePolicy::Fixed)),
            ("elastic", Some(ComputePolicy::Elastic)),
            ("Elastic", Some(ComputePolicy::Elastic)),
            ("none", Some(ComputePolicy::None)),
            ("NONE", Some(ComputePolicy::None)),
            ("", None),
            ("fix", None),
            ("elastic2", None),
            ("off", None),
            ("fixed elastic", None),
        ];
        for &(input, want) in table {
            assert_eq!(ComputePolicy::parse(input), want, "{input:?}");
            if let Some(p) = want {
                assert_eq!(ComputePolicy::parse(p.as_str()), Some(p));
            }
        }
        let e = err(&[
            ("CUDA_LIMITER_SM_LIMIT", "30"),
            ("CUDA_LIMITER_SM_POLICY_2", "burst"),
        ]);
        assert_eq!(
            e.to_string(),
            "CUDA_LIMITER_SM_POLICY_2=\"burst\" is not a policy (expected fixed, elastic or none)"
        );
    }

    #[test]
    fn percents() {
        let table: &[(&str, Option<u8>)] = &[
            ("0", Some(0)),
            ("1", Some(1)),
            ("050", Some(50)),
            ("99", Some(99)),
            ("100", Some(100)),
            (" 42 ", Some(42)),
            ("42%", Some(42)),
            ("101", None),
            ("256", None),
            ("-1", None),
            ("", None),
            ("%", None),
            ("4.5", None),
            ("fifty", None),
            ("99999999999999999999", None),
        ];
        for &(input, want) in table {
            assert_eq!(parse_percent(input), want, "{input:?}");
        }
    }

    #[test]
    fn soft_below_hard_and_missing_limits() {
        const BELOW: &str = "(expected a soft limit, the elastic ceiling, of at least the limit)";
        const TOO: &str = "to be set too)";
        let table: &[(&str, &str)] = &[
            (
                "CUDA_CORE_LIMIT_0=50|CUDA_CORE_SOFT_LIMIT_0=40",
                "CUDA_CORE_SOFT_LIMIT_0=\"40\" is below CUDA_CORE_LIMIT_0=\"50\" {BELOW}",
            ),
            (
                "~SM_LIMIT=50|~SM_SOFT_LIMIT=40",
                "CUDA_LIMITER_SM_SOFT_LIMIT=\"40\" is below CUDA_LIMITER_SM_LIMIT=\"50\" {BELOW}",
            ),
            (
                "~SM_LIMIT=50|~SM_POLICY=elastic|~SM_SOFT_LIMIT=40",
                "CUDA_LIMITER_SM_SOFT_LIMIT=\"40\" is below CUDA_LIMITER_SM_LIMIT=\"50\" {BELOW}",
            ),
            (
                "~SM_LIMIT_1=50|~SM_POLICY=elastic|~SM_SOFT_LIMIT=10",
                "CUDA_LIMITER_SM_SOFT_LIMIT=\"10\" is below CUDA_LIMITER_SM_LIMIT_1=\"50\" {BELOW}",
            ),
            (
                "CUDA_CORE_SOFT_LIMIT_3=40",
                "CUDA_CORE_SOFT_LIMIT_3=\"40\" has no limit to apply to (expected CUDA_CORE_LIMIT_3 {TOO}",
            ),
            (
                "~SM_POLICY_2=elastic",
                "CUDA_LIMITER_SM_POLICY_2=\"elastic\" has no limit to apply to \
                 (expected CUDA_LIMITER_SM_LIMIT_2 or CUDA_LIMITER_SM_LIMIT {TOO}",
            ),
            (
                "~SM_SOFT_LIMIT_2=70|CUDA_DEVICE_SM_LIMIT=30",
                "CUDA_LIMITER_SM_SOFT_LIMIT_2=\"70\" has no limit to apply to \
                 (expected CUDA_LIMITER_SM_LIMIT_2 or CUDA_LIMITER_SM_LIMIT {TOO}",
            ),
            (
                "~SM_POLICY=elastic",
                "CUDA_LIMITER_SM_POLICY=\"elastic\" has no limit to apply to \
                 (expected CUDA_LIMITER_SM_LIMIT or CUDA_LIMITER_SM_LIMIT_<i> {TOO}",
            ),
            (
                "~SM_SOFT_LIMIT=80|CUDA_DEVICE_SM_LIMIT=30",
                "CUDA_LIMITER_SM_SOFT_LIMIT=\"80\" has no limit to apply to \
                 (expected CUDA_LIMITER_SM_LIMIT or CUDA_LIMITER_SM_LIMIT_<i> {TOO}",
            ),
        ];
        for &(spec, want) in table {
            let want = want.replace("{BELOW}", BELOW).replace("{TOO}", TOO);
            assert_eq!(err_spec(spec).to_string(), want, "{spec}");
        }
    }

    #[test]
    fn json_errors() {
        let table: &[(&str, &str, &str)] = &[
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "[1073741824]",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT="[1073741824]" is not a JSON object (found an array; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "1073741824",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT="1073741824" is not a JSON object (found a number; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 1"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT='{"0": 1' is not a JSON object (EOF while parsing an object at line 1 column 7; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT="" is not a JSON object (EOF while parsing a value at line 1 column 0; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": -1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has "0": -1, which is not bytes as a whole number or a size string such as "4g""#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 1.5}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has "0": 1.5, which is not bytes as a whole number or a size string such as "4g""#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": null}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has "0": null, which is not bytes as a whole number or a size string such as "4g""#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": "4x"}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT["0"]="4x" is not a size (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"foo": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "foo", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"16": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "16", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"01": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "01", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"GPU-": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "GPU-", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "{\"\\n\": 1}",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "\n", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"GPU-abc": 1, "gpu-ABC": 2}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT names one device twice, as "GPU-abc" and "gpu-ABC" (expected each device once)"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                r#"{"0": 101}"#,
                r#"TENSOR_FUSION_CUDA_UP_LIMIT has "0": 101, which is not a whole-number percent from 0 to 100"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                r#"{"0": "50"}"#,
                r#"TENSOR_FUSION_CUDA_UP_LIMIT has "0": "50", which is not a whole-number percent from 0 to 100"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                "null",
                r#"TENSOR_FUSION_CUDA_UP_LIMIT="null" is not a JSON object (found null; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 50} or {"0": 30})"#,
            ),
        ];
        for &(name, value, want) in table {
            assert_eq!(err(&[(name, value)]).to_string(), want, "{name}={value}");
        }
    }

    #[test]
    fn device_suffixes() {
        // (name, Ok(Some(index)) / Ok(None) ignored / Err(message))
        let table: &[(&str, Result<Option<u32>, &str>)] = &[
            ("CUDA_LIMITER_MEMORY_LIMIT_0", Ok(Some(0))),
            ("CUDA_LIMITER_MEMORY_LIMIT_15", Ok(Some(15))),
            (
                "CUDA_LIMITER_MEMORY_LIMIT_16",
                Err(
                    "CUDA_LIMITER_MEMORY_LIMIT_16=\"1g\" names device 16, but device indices go from 0 to 15",
                ),
            ),
            (
                "CUDA_DEVICE_MEMORY_LIMIT_16",
                Err(
                    "CUDA_DEVICE_MEMORY_LIMIT_16=\"1g\" names device 16, but device indices go from 0 to 15",
                ),
            ),
            (
                "CUDA_MEM_LIMIT_99999999999999999999",
                Err(
                    "CUDA_MEM_LIMIT_99999999999999999999=\"1g\" names device 99999999999999999999, but device indices go from 0 to 15",
                ),
            ),
            (
                "CUDA_LIMITER_MEMORY_LIMIT_x",
                Err(
                    "CUDA_LIMITER_MEMORY_LIMIT_x=\"1g\" has device suffix \"x\", which is not a device index (expected CUDA_LIMITER_MEMORY_LIMIT_<i> with i from 0 to 15)",
                ),
            ),
            (
                "CUDA_LIMITER_MEMORY_LIMIT_",
                Err(
                    "CUDA_LIMITER_MEMORY_LIMIT_=\"1g\" has device suffix \"\", which is not a device index (expected CUDA_LIMITER_MEMORY_LIMIT_<i> with i from 0 to 15)",
                ),
            ),
            (
                "CUDA_LIMITER_MEMORY_LIMIT_01",
                Err(
                    "CUDA_LIMITER_MEMORY_LIMIT_01=\"1g\" has device suffix \"01\", which is not a device index (expected CUDA_LIMITER_MEMORY_LIMIT_<i> with i from 0 to 15)",
                ),
            ),
            (
                "CUDA_MEM_LIMIT_1a",
                Err(
                    "CUDA_MEM_LIMIT_1a=\"1g\" has device suffix \"1a\", which is not a device index (expected CUDA_MEM_LIMIT_<i> with i from 0 to 15)",
                ),
            ),
            // Foreign names with a non-numeric suffix belong to someone else.
            ("CUDA_DEVICE_MEMORY_LIMIT_X", Ok(None)),
            ("CUDA_MEM_LIMIT_FOO", Ok(None)),
            ("CUDA_MEM_LIMIT", Ok(None)),
            // Unknown CUDA_LIMITER_* names are ignored.
            ("CUDA_LIMITER_MEMORY_LIMT", Ok(None)),
            ("CUDA_LIMITER_MEMORYLIMIT_0", Ok(None)),
            ("CUDA_LIMITER_POD_NAME", Ok(None)),
            ("CUDA_LIMITER_LOG", Ok(None)),
            ("cuda_limiter_memory_limit", Ok(None)),
            ("CUDA_DEVICE_MEMORY_SHARED_CACHE", Ok(None)),
        ];
        for &(name, want) in table {
            let got = cfg(&[(name, "1g")]);
            match (got, want) {
                (Ok(c), Ok(Some(i))) => {
                    assert_eq!(c.memory.resolve(i, None), Some(GIB), "{name}");
                    assert_eq!(c.memory.resolve(i + 1, None), None, "{name}");
                }
                (Ok(c), Ok(None)) => assert_eq!(c, LimiterConfig::default(), "{name}"),
                (Err(e), Err(msg)) => assert_eq!(e.to_string(), msg, "{name}"),
                (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
            }
        }
        let e = err(&[("CUDA_CORE_LIMIT_16", "50")]);
        assert!(matches!(e, ConfigError::IndexOutOfRange { .. }), "{e}");
        let e = err(&[("CUDA_LIMITER_SM_SOFT_LIMIT_y", "50")]);
        assert!(matches!(e, ConfigError::BadSuffix { .. }), "{e}");
    }

    #[test]
    fn pod_and_hypervisor() {
        let c = ok(&[]);
        assert_eq!(c.pod.as_str(), "default");
        assert_eq!(c.hypervisor, None);
        let c = ok(&[
            ("CUDA_LIMITER_POD", " team-a.job_7 "),
            ("CUDA_LIMITER_HYPERVISOR", " http://127.0.0.1:8000 "),
        ]);
        assert_eq!(c.pod.to_string(), "team-a.job_7");
        assert_eq!(c.hypervisor.as_deref(), Some("http://127.0.0.1:8000"));

        let long = "a".repeat(64);
        let too_long = "a".repeat(65);
        let table: &[(&str, bool)] = &[
            ("default", true),
            ("A-Za-z0-9_.-", true),
            (long.as_str(), true),
            ("x", true),
            ("", false),
            (too_long.as_str(), false),
            ("pod/1", false),
            ("pod 1", false),
            ("pöd", false),
            ("pod:1", false),
        ];
        for &(id, valid) in table {
            assert_eq!(PodId::new(id).is_ok(), valid, "{id:?}");
            assert_eq!(id.parse::<PodId>().is_ok(), valid, "{id:?}");
            assert_eq!(cfg(&[("CUDA_LIMITER_POD", id)]).is_ok(), valid, "{id:?}");
        }
        assert_eq!(
            err(&[("CUDA_LIMITER_POD", "pod/1")]).to_string(),
            "CUDA_LIMITER_POD=\"pod/1\" is not a pod id (expected 1 to 64 characters of A-Z, a-z, 0-9, '_', '.' and '-')"
        );
        assert_eq!(
            err(&[("CUDA_LIMITER_HYPERVISOR", "  ")]).to_string(),
            "CUDA_LIMITER_HYPERVISOR=\"  \" is empty (expected an address such as http://127.0.0.1:8000, or leave it unset for local mode)"
        );
    }

    #[test]
    fn every_error_is_one_line_naming_the_variable() {
        let table: &[(&str, &str)] = &[
            ("CUDA_LIMITER_MEMORY_LIMIT", "4x"),
            ("CUDA_LIMITER_MEMORY_LIMIT_3", "1\n2"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "-1"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", ""),
            ("CUDA_MEM_LIMIT_2", "1.5g"),
            ("VCUDA_MEMORY_LIMIT", "99999999999999999999"),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", "{\n\"0\": -1\n}"),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", "{\n\"0\":\n"),
            ("TENSOR_FUSION_CUDA_UP_LIMIT", "{\"zz\":\n1}"),
            ("CUDA_LIMITER_SM_LIMIT", "101"),
            ("CUDA_LIMITER_SM_LIMIT_1", "-5"),
            ("CUDA_LIMITER_SM_POLICY", "sometimes\r\n"),
            ("CUDA_LIMITER_SM_SOFT_LIMIT_0", "x"),
            ("CUDA_DEVICE_SM_LIMIT", "1e2"),
            ("CUDA_DEVICE_SM_LIMIT_4", "half"),
            ("CUDA_CORE_LIMIT_0", "200"),
            ("CUDA_CORE_SOFT_LIMIT_0", "7"),
            ("CUDA_LIMITER_POD", "a\nb"),
            ("CUDA_LIMITER_HYPERVISOR", "\n"),
            ("CUDA_LIMITER_MEMORY_LIMIT_x\ny", "1g"),
        ];
        for &(name, value) in table {
            let msg = err(&[(name, value)]).to_string();
            assert!(!msg.contains(['\n', '\r']), "{name}: {msg:?}");
            assert!(
                msg.starts_with(name.lines().next().unwrap_or(name)),
                "{name}: {msg}"
            );
        }
    }

    #[test]
    fn non_utf8_values() {
        use std::os::unix::ffi::OsStrExt;
        let bad = OsStr::from_bytes(b"4\xffg");
        // Ours: an error.
        let mut raw = RawVars::default();
        let e = raw.add("CUDA_DEVICE_MEMORY_LIMIT_1", Err(bad)).err();
        assert_eq!(
            e.map(|e| e.to_string()).as_deref(),
            Some("CUDA_DEVICE_MEMORY_LIMIT_1=\"4\u{fffd}g\" is not valid UTF-8")
        );
        // Someone else's: ignored.
        let mut raw = RawVars::default();
        assert_eq!(raw.add("LS_COLORS", Err(bad)), Ok(()));
        assert_eq!(raw.add("CUDA_LIMITER_LOG", Err(bad)), Ok(()));
        assert_eq!(raw.add("CUDA_LIMITER_MEMORY_LIMIT", Ok("1g")), Ok(()));
        let c = raw.finish();
        assert_eq!(c.map(|c| c.memory.resolve(0, None)), Ok(Some(GIB)));
    }

    #[test]
    fn later_values_win_and_unrelated_are_ignored() {
        let c = ok(&[
            ("PATH", "/usr/bin"),
            ("CUDA_VISIBLE_DEVICES", "1,2"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "4x"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", "4g"),
            ("TENSOR_FUSION_OTHER", "{"),
        ]);
        assert_eq!(c.memory.resolve(0, None), Some(4 * GIB));
        assert!(c.compute.is_empty());
    }

    #[test]
    fn errors_do_not_depend_on_environment_order() {
        let a = ("CUDA_DEVICE_SM_LIMIT", "bad");
        let b = ("CUDA_LIMITER_MEMORY_LIMIT", "bad");
        assert_eq!(err(&[a, b]), err(&[b, a]));
        assert!(matches!(err(&[a, b]), ConfigError::Size { .. }));
    }

    #[test]
    fn from_env_matches_from_vars() {
        let vars = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)));
        assert_eq!(LimiterConfig::from_env(), LimiterConfig::from_vars(vars));
    }

    #[test]
    fn compute_ceiling() {
        assert_eq!(ComputeLimit::fixed(30).ceiling(), 30);
        assert_eq!(elastic(30, Some(60)).ceiling(), 60);
        assert_eq!(elastic(30, None).ceiling(), 100);
    }
}
