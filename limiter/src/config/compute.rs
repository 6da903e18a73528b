//! Compute keys: a limit, a policy and a soft limit combined into one
//! [`ComputeLimit`] per key.

use gpushare_utils::MAX_DEVICES;

use super::limits::Device;
use super::percent::{ceiling, limited};
use super::scan::Val;
use super::vars::{Scope, rank};
use super::{ComputeLimit, ComputePolicy, ConfigError, DeviceLimits};

#[derive(Default, Clone, Copy)]
pub(super) struct SmTriple<'a> {
    pub(super) limit: Option<Val<'a, u8>>,
    pub(super) policy: Option<Val<'a, ComputePolicy>>,
    pub(super) soft: Option<Val<'a, u8>>,
}

impl SmTriple<'_> {
    pub(super) fn is_empty(&self) -> bool {
        self.limit.is_none() && self.policy.is_none() && self.soft.is_none()
    }
}

/// `CUDA_LIMITER_SM_{LIMIT,POLICY,SOFT_LIMIT}[_<i>]`.
#[derive(Default)]
pub(super) struct OursSm<'a> {
    pub(super) all: SmTriple<'a>,
    pub(super) per: [SmTriple<'a>; MAX_DEVICES],
}

impl<'a> OursSm<'a> {
    pub(super) fn slot(&mut self, scope: Scope) -> &mut SmTriple<'a> {
        match scope {
            Scope::Index(i) if (i as usize) < MAX_DEVICES => &mut self.per[i as usize],
            // classify() only makes indices below MAX_DEVICES.
            _ => &mut self.all,
        }
    }

    pub(super) fn push_to(&self, out: &mut DeviceLimits<ComputeLimit>) -> Result<(), ConfigError> {
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
pub(super) fn combine(
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
        Some(s) if s.parsed < hard => return Err(soft_below_hard(s, limit.name, hard)),
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
pub(super) type SourcedLimit<'a> = (Option<ComputeLimit>, &'a str);

/// `CUDA_CORE_LIMIT_<i>` and `CUDA_CORE_SOFT_LIMIT_<i>`.
#[derive(Default)]
pub(super) struct CorePair<'a> {
    pub(super) hard: Option<Val<'a, u8>>,
    pub(super) soft: Option<Val<'a, u8>>,
}

impl<'a> CorePair<'a> {
    /// The key for device `i`, with its source variable; `None` when unset.
    pub(super) fn resolve(&self, i: u32) -> Result<Option<SourcedLimit<'a>>, ConfigError> {
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
            Some(s) if s.parsed < percent => return Err(soft_below_hard(s, hard.name, percent)),
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

/// A soft limit (the elastic ceiling) below the limit it goes with.
pub(super) fn soft_below_hard(soft: Val<'_, u8>, hard_var: &str, hard: u8) -> ConfigError {
    ConfigError::SoftBelowHard {
        soft_var: soft.name.to_owned(),
        soft: soft.parsed,
        hard_var: hard_var.to_owned(),
        hard,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::limits::Resolved;
    use crate::config::test_support::*;
    use crate::config::*;

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
}
