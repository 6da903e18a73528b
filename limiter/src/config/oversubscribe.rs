//! Oversubscription: the switches that let allocations past the quota be
//! served from host memory, and the cap on that memory (unset: the shared
//! default, [`gpushare_utils::limits::default_spill_limit`]).

use gpushare_utils::units::{parse_size, parse_switch};

use super::ConfigError;
use super::limits::{Device, DeviceLimits};
use super::scan::RawVar;
use super::vars::{Kind, Scope, rank};

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
    }
}
