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
//! `CUDA_VISIBLE_DEVICES`, from 0 to 15 ([`MAX_DEVICES`](gpushare_utils::MAX_DEVICES) - 1), written without
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
//! [`parse_size`](gpushare_utils::units::parse_size) (shared with the
//! hypervisor).
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
//! # Oversubscription (host memory past the quota)
//!
//! | variable | scope | value |
//! | --- | --- | --- |
//! | `CUDA_LIMITER_OVERSUBSCRIBE_<i>` | device `i` | switch |
//! | `CUDA_MEM_OVERSOLD_<i>` (VGPU-Controller) | device `i` | switch |
//! | `CUDA_LIMITER_OVERSUBSCRIBE` | all devices | switch |
//! | `CUDA_OVERSUBSCRIBE` (HAMi) | all devices | switch |
//! | `CUDA_LIMITER_SPILL_LIMIT_<i>`, `CUDA_LIMITER_SPILL_LIMIT` | device `i`, all | size: the pod's host-memory cap per device (0 = no spill) |
//!
//! A *switch* is `true`/`false`, `1`/`0`, `yes`/`no` or `on`/`off`
//! (case-insensitive). Off unless set; per-device before all-devices, ours
//! before the foreign names. The spill cap defaults to a quarter of the
//! node's memory ([`default_spill_limit`](gpushare_utils::limits::default_spill_limit),
//! shared with the hypervisor).
//!
//! # Other
//!
//! | variable | value |
//! | --- | --- |
//! | `CUDA_LIMITER_POD` | pod identity, see [`PodId`]; default `default` |
//! | `CUDA_LIMITER_HYPERVISOR` | hypervisor address, e.g. `http://127.0.0.1:8000`; unset means local mode |
//! | `CUDA_LIMITER_CLASS`, `CUDA_LIMITER_CLASS_<i>` | `latency` or `batch` (default), see [`PodClass`](gpushare_utils::pod::PodClass) |
//! | `CUDA_LIMITER_MPS` | `required` or unset: with `required`, CUDA is refused unless every device runs as an MPS client, see [`MpsMode`] |
//! | `CUDA_LIMITER_FAST_SWAP` | switch, off unless set: allocations of 2 MiB and more are backed by the limiter with the VMM API, so that a swap moves them at the speed of the link (`crate::backing`) |
//!
//! Other `CUDA_LIMITER_*` names (typos included) are ignored, except a variable
//! of ours with a device suffix that is not an index (`CUDA_LIMITER_MEMORY_LIMIT_x`),
//! which is an error. Foreign variables with a non-numeric suffix belong to
//! their own systems and are ignored; a foreign suffix that starts with a digit
//! but is not a valid index (`CUDA_MEM_LIMIT_01`, `CUDA_MEM_LIMIT_16`) is an error.

mod class;
mod compute;
mod error;
mod fast_swap;
#[cfg(test)]
mod fuzz;
mod limits;
mod mps;
mod oversubscribe;
mod percent;
mod resolve;
mod scan;
mod tensor_fusion;
#[cfg(test)]
mod test_support;
mod vars;

pub(crate) use class::DeviceClasses;
pub(crate) use error::ConfigError;
pub(crate) use limits::{ComputeLimit, ComputePolicy, DeviceLimits};
pub(crate) use mps::MpsMode;

use gpushare_utils::pod::PodId;
use scan::RawVars;

/// The limiter's configuration in local mode.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct LimiterConfig {
    pub pod: PodId,
    /// Bytes.
    pub memory: DeviceLimits<u64>,
    pub compute: DeviceLimits<ComputeLimit>,
    /// Oversubscription: `Some(true)` where allocations past the quota may be
    /// served from host memory; unset or `None` (explicitly off): never.
    pub oversubscribe: DeviceLimits<bool>,
    /// The pod's cap on that host memory per device, in bytes (0 = none);
    /// unset: [`default_spill_limit`](gpushare_utils::limits::default_spill_limit).
    pub spill_limit: DeviceLimits<u64>,
    /// Address of the node hypervisor, e.g. `http://127.0.0.1:8000`; `None`: local mode.
    pub hypervisor: Option<String>,
    /// The pod's class per device (`CUDA_LIMITER_CLASS[_<i>]`).
    pub class: DeviceClasses,
    /// Whether CUDA runs only as an MPS client (`CUDA_LIMITER_MPS`).
    pub mps: MpsMode,
    /// Whether large device allocations are backed by the limiter for a
    /// fast swap (`CUDA_LIMITER_FAST_SWAP`; `crate::backing`).
    pub fast_swap: bool,
}

impl LimiterConfig {
    /// Reads the process environment (one pass over `std::env::vars_os`).
    ///
    /// Variables with non-UTF-8 names or values are skipped unless they are
    /// ones we read; a non-UTF-8 value of one we read is an error.
    pub(crate) fn from_env() -> Result<Self, ConfigError> {
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
    /// given twice, the last value wins. (Tests only: the library reads its
    /// own environment.)
    #[cfg(test)]
    pub(crate) fn from_vars<I, K, V>(vars: I) -> Result<Self, ConfigError>
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
