//! The `[swap]` table of the config file.

use std::time::Duration;

use gpushare_utils::quote::quoted;
use gpushare_utils::units::parse_size;
use serde::Deserialize;

use super::{ConfigError, OvercommitRatio, SizeValue, SwapSettings};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawSwap {
    overcommit: Option<Overcommit>,
    overcommit_ratio: Option<f64>,
    idle_after_ms: Option<u64>,
    latency_pods: Option<String>,
    ranking: Option<String>,
    min_resident_ms: Option<u64>,
    headroom: Option<SizeValue>,
    host_limit: Option<SizeValue>,
    room_wait_ms: Option<u64>,
    prepare_ahead: Option<SizeValue>,
    cuda_library: Option<String>,
    drain_unhealthy: Option<bool>,
}

/// `overcommit = true` (every GPU), `false`, or a list of NVML indexes.
#[derive(Deserialize)]
#[serde(untagged)]
enum Overcommit {
    All(bool),
    Gpus(Vec<u32>),
}

pub(super) fn settings(raw: Option<RawSwap>) -> Result<SwapSettings, ConfigError> {
    let defaults = SwapSettings::default();
    let Some(raw) = raw else {
        return Ok(defaults);
    };
    let invalid = |key: &str, value: &str| ConfigError::Swap(format!("{key} = {}", quoted(value)));
    let latency_pods = match raw.latency_pods.as_deref() {
        None => defaults.latency_pods,
        Some(text) => hypervisor_swap::LatencyPods::parse(text)
            .ok_or_else(|| invalid("latency_pods", text))?,
    };
    let ranking = match raw.ranking.as_deref() {
        None => defaults.ranking,
        Some(text) => {
            hypervisor_swap::Ranking::parse(text).ok_or_else(|| invalid("ranking", text))?
        }
    };
    let size = |key: &str, value: &Option<SizeValue>, default: u64| match value {
        None => Ok(default),
        Some(SizeValue::Bytes(bytes)) => Ok(*bytes),
        Some(SizeValue::Text(text)) => parse_size(text).map_err(|_| invalid(key, text)),
    };
    let host_limit = size("host_limit", &raw.host_limit, defaults.host_limit)?;
    let headroom = size("headroom", &raw.headroom, defaults.headroom)?;
    let prepare_ahead = size(
        "prepare_ahead",
        &raw.prepare_ahead,
        headroom.saturating_mul(2),
    )?;
    let overcommit_ratio = match raw.overcommit_ratio {
        None => defaults.overcommit_ratio,
        Some(ratio) => OvercommitRatio::new(ratio).ok_or_else(|| {
            ConfigError::Swap(format!(
                "overcommit_ratio = {ratio}: a ratio from 1 to {} (1.5: quotas up to one and a half times the memory)",
                OvercommitRatio::MAX
            ))
        })?,
    };
    Ok(SwapSettings {
        overcommit: match raw.overcommit {
            None | Some(Overcommit::All(false)) => Some(Vec::new()),
            Some(Overcommit::All(true)) => None,
            Some(Overcommit::Gpus(gpus)) => Some(gpus),
        },
        overcommit_ratio,
        idle_after: raw
            .idle_after_ms
            .map_or(defaults.idle_after, |ms| Duration::from_millis(ms.max(100))),
        latency_pods,
        ranking,
        min_resident: raw
            .min_resident_ms
            .map_or(defaults.min_resident, Duration::from_millis),
        headroom,
        host_limit,
        room_wait: raw
            .room_wait_ms
            .map_or(defaults.room_wait, Duration::from_millis),
        prepare_ahead,
        cuda_library: raw.cuda_library.unwrap_or(defaults.cuda_library),
        drain_unhealthy: raw.drain_unhealthy.unwrap_or(defaults.drain_unhealthy),
    })
}
