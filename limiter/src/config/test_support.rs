//! Helpers shared by the configuration tests.

use super::*;

pub(crate) const GIB: u64 = 1 << 30;
pub(crate) const MIB: u64 = 1 << 20;
pub(crate) const UUID: &str = "GPU-3430f778-7a25-704c-9090-8b0bb2478114";

pub(crate) fn cfg(vars: &[(&str, &str)]) -> Result<LimiterConfig, ConfigError> {
    LimiterConfig::from_vars(vars.iter().copied())
}

pub(crate) fn ok(vars: &[(&str, &str)]) -> LimiterConfig {
    match cfg(vars) {
        Ok(c) => c,
        Err(e) => panic!("{vars:?}: unexpected error: {e}"),
    }
}

pub(crate) fn err(vars: &[(&str, &str)]) -> ConfigError {
    match cfg(vars) {
        Ok(c) => panic!("{vars:?}: expected an error, got {c:?}"),
        Err(e) => e,
    }
}

/// Variables separated by `|`, e.g. `"~SM_LIMIT=30|CUDA_CORE_LIMIT_0=50"`;
/// a leading `~` stands for `CUDA_LIMITER_`. Values are kept verbatim.
pub(crate) fn env(spec: &str) -> Vec<(String, String)> {
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

pub(crate) fn ok_spec(spec: &str) -> LimiterConfig {
    match LimiterConfig::from_vars(env(spec)) {
        Ok(c) => c,
        Err(e) => panic!("{spec}: unexpected error: {e}"),
    }
}

pub(crate) fn err_spec(spec: &str) -> ConfigError {
    match LimiterConfig::from_vars(env(spec)) {
        Ok(c) => panic!("{spec}: expected an error, got {c:?}"),
        Err(e) => e,
    }
}

pub(crate) fn elastic(percent: u8, soft_percent: Option<u8>) -> ComputeLimit {
    ComputeLimit {
        percent,
        policy: ComputePolicy::Elastic,
        soft_percent,
    }
}
