//! Resolution: the collected variables parsed in a fixed order, so the error
//! reported does not depend on the order of the environment.

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::pod::{PodClass, PodId};
use gpushare_utils::units::parse_size;

use super::compute::{CorePair, OursSm};
use super::error::{MEM_JSON_EXAMPLE, UP_JSON_EXAMPLE};
use super::fast_swap::parse_fast_swap;
use super::limits::Device;
use super::mps::parse_mps;
use super::oversubscribe::{push_oversubscribe, push_spill_limit};
use super::percent::{limited, parse_percent};
use super::scan::{RawVar, RawVars, Val};
use super::tensor_fusion::{json_bytes, json_percent, parse_json_limits};
use super::vars::{Kind, Scope, rank};
use super::{ComputeLimit, ComputePolicy, ConfigError, LimiterConfig};

impl RawVars {
    pub(super) fn finish(mut self) -> Result<LimiterConfig, ConfigError> {
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
                Kind::Oversub | Kind::OversubHami | Kind::OversubVgpu => {
                    push_oversubscribe(v, &mut config.oversubscribe)?;
                }
                Kind::SpillLimit => push_spill_limit(v, &mut config.spill_limit)?,
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
                Kind::Class => {
                    let class = PodClass::parse(&v.value).ok_or_else(|| ConfigError::Class {
                        var: v.name.clone(),
                        value: v.value.clone(),
                    })?;
                    let index = match v.scope {
                        Scope::All => None,
                        Scope::Index(i) => Some(i),
                    };
                    config.class.set(index, class);
                }
                Kind::Mps => config.mps = parse_mps(v)?,
                Kind::FastSwap => config.fast_swap = parse_fast_swap(v)?,
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

pub(super) fn percent(v: &RawVar) -> Result<u8, ConfigError> {
    parse_percent(&v.value).ok_or_else(|| ConfigError::Percent {
        var: v.name.clone(),
        value: v.value.clone(),
    })
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

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
            (long.as_str(), true),
            ("", false),
            (too_long.as_str(), false),
            ("pod/1", false),
            ("pöd", false),
        ];
        for &(id, valid) in table {
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
}
