//! Oversubscription: the switches that let allocations past the quota be
//! served from host memory, and the cap on that memory.

use super::limits::{Device, DeviceLimits};
use super::scan::RawVar;
use super::vars::{Kind, Scope, rank};
use super::{ConfigError, parse_size};

/// Without `CUDA_LIMITER_SPILL_LIMIT`, a pod may spill this fraction (1/N) of
/// the node's memory per device: pinned pages cannot be swapped or reclaimed,
/// so the node keeps the rest for the pods' own host memory and the kernel.
pub const SPILL_DEFAULT_DIVISOR: u64 = 4;

/// `true`/`1`/`yes`/`on` or `false`/`0`/`no`/`off`, case-insensitive,
/// surrounding whitespace allowed.
pub fn parse_switch(s: &str) -> Option<bool> {
    let s = s.trim();
    let is = |words: [&str; 4]| words.iter().any(|w| w.eq_ignore_ascii_case(s));
    if is(["true", "1", "yes", "on"]) {
        Some(true)
    } else if is(["false", "0", "no", "off"]) {
        Some(false)
    } else {
        None
    }
}

/// The default spill cap: [`SPILL_DEFAULT_DIVISOR`]th of `MemTotal` in
/// `/proc/meminfo`; 0 (no spill) when it cannot be read.
pub fn default_spill_limit() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|text| mem_total(&text))
        .map_or(0, |bytes| bytes / SPILL_DEFAULT_DIVISOR)
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

fn device_of(v: &RawVar) -> Device {
    match v.scope {
        Scope::All => Device::All,
        Scope::Index(i) => Device::Index(i),
    }
}

pub(super) fn push_oversubscribe(
    v: &RawVar,
    into: &mut DeviceLimits<bool>,
) -> Result<(), ConfigError> {
    let on = parse_switch(&v.value).ok_or_else(|| ConfigError::Switch {
        var: v.name.clone(),
        value: v.value.clone(),
    })?;
    let rank = match (v.kind, v.scope) {
        (Kind::Oversub, Scope::Index(_)) => rank::OURS_INDEX,
        (Kind::OversubVgpu, _) => rank::LEGACY_INDEX,
        (Kind::Oversub, Scope::All) => rank::OURS_ALL,
        _ => rank::HAMI_ALL,
    };
    into.push(rank, device_of(v), on.then_some(true), v.name.clone());
    Ok(())
}

pub(super) fn push_spill_limit(
    v: &RawVar,
    into: &mut DeviceLimits<u64>,
) -> Result<(), ConfigError> {
    let bytes = parse_size(&v.value).map_err(|error| ConfigError::Size {
        var: v.name.clone(),
        error,
    })?;
    let rank = match v.scope {
        Scope::Index(_) => rank::OURS_INDEX,
        Scope::All => rank::OURS_ALL,
    };
    into.push(rank, device_of(v), Some(bytes), v.name.clone());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn oversubscription_is_off_unless_a_switch_turns_it_on() {
        // (variables, device 0 on, device 1 on)
        type Case<'a> = (&'a [(&'a str, &'a str)], bool, bool);
        let table: &[Case] = &[
            (&[], false, false),
            (&[("CUDA_OVERSUBSCRIBE", "true")], true, true),
            (&[("CUDA_OVERSUBSCRIBE", "TRUE ")], true, true),
            (&[("CUDA_OVERSUBSCRIBE", "false")], false, false),
            (&[("CUDA_MEM_OVERSOLD_1", "true")], false, true),
            (&[("CUDA_LIMITER_OVERSUBSCRIBE", "1")], true, true),
            (&[("CUDA_LIMITER_OVERSUBSCRIBE_0", "on")], true, false),
            // Per device beats all devices; ours beats the foreign names.
            (
                &[
                    ("CUDA_OVERSUBSCRIBE", "true"),
                    ("CUDA_LIMITER_OVERSUBSCRIBE_1", "off"),
                ],
                true,
                false,
            ),
            (
                &[
                    ("CUDA_OVERSUBSCRIBE", "true"),
                    ("CUDA_LIMITER_OVERSUBSCRIBE", "no"),
                ],
                false,
                false,
            ),
            (
                &[
                    ("CUDA_LIMITER_OVERSUBSCRIBE", "false"),
                    ("CUDA_MEM_OVERSOLD_0", "true"),
                ],
                true,
                false,
            ),
        ];
        for &(vars, zero, one) in table {
            let c = ok(vars);
            assert_eq!(
                c.oversubscribe.resolve(0, None),
                zero.then_some(true),
                "{vars:?}"
            );
            assert_eq!(
                c.oversubscribe.resolve(1, None),
                one.then_some(true),
                "{vars:?}"
            );
        }
    }

    #[test]
    fn malformed_switches_and_caps_are_errors() {
        assert_eq!(
            err(&[("CUDA_OVERSUBSCRIBE", "maybe")]).to_string(),
            "CUDA_OVERSUBSCRIBE=\"maybe\" is not a switch (expected true or false)"
        );
        assert!(matches!(
            err(&[("CUDA_MEM_OVERSOLD_0", "")]),
            ConfigError::Switch { .. }
        ));
        assert!(matches!(
            err(&[("CUDA_LIMITER_OVERSUBSCRIBE_x", "true")]),
            ConfigError::BadSuffix { .. }
        ));
        assert!(matches!(
            err(&[("CUDA_LIMITER_SPILL_LIMIT", "lots")]),
            ConfigError::Size { .. }
        ));
    }

    #[test]
    fn spill_caps_per_device_and_default() {
        let c = ok(&[
            ("CUDA_LIMITER_SPILL_LIMIT", "8g"),
            ("CUDA_LIMITER_SPILL_LIMIT_1", "0"),
        ]);
        assert_eq!(c.spill_limit.resolve(0, None), Some(8 * GIB));
        assert_eq!(c.spill_limit.resolve(1, None), Some(0));
        assert_eq!(ok(&[]).spill_limit.resolve(0, None), None);
        let meminfo = "MemTotal:       131072000 kB\nMemFree:        1 kB\n";
        assert_eq!(mem_total(meminfo), Some(131_072_000 * 1024));
        assert_eq!(mem_total("MemFree: 1 kB\n"), None);
        assert!(
            default_spill_limit() > 0,
            "this machine has a /proc/meminfo"
        );
    }
}
