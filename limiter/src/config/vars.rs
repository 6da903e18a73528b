//! The variable table: which environment variables are ours, what each sets
//! and for which devices, and their precedence ranks.

use gpushare_utils::MAX_DEVICES;

// ---------------------------------------------------------------------------
// Reading: first collect the variables we know (last value of a name wins),
// then parse them in a fixed order so the error reported does not depend on
// the order of the environment.

/// What a variable sets. The order is the parse order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Kind {
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
    Oversub,
    OversubHami,
    OversubVgpu,
    SpillLimit,
    Pod,
    Hypervisor,
    Class,
    Mps,
    FastSwap,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Scope {
    All,
    Index(u32),
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Scopes {
    AllOnly,
    IndexOnly,
    Both,
}

/// Our variables, and foreign ones we read: name, what it sets, which scopes.
/// Ours (`CUDA_LIMITER_*`) treat a non-index suffix as an error rather than as
/// someone else's variable.
pub(super) const RULES: [(&str, Kind, Scopes); 21] = [
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
    ("CUDA_LIMITER_OVERSUBSCRIBE", Kind::Oversub, Scopes::Both),
    ("CUDA_OVERSUBSCRIBE", Kind::OversubHami, Scopes::AllOnly),
    ("CUDA_MEM_OVERSOLD", Kind::OversubVgpu, Scopes::IndexOnly),
    ("CUDA_LIMITER_SPILL_LIMIT", Kind::SpillLimit, Scopes::Both),
    ("CUDA_LIMITER_POD", Kind::Pod, Scopes::AllOnly),
    ("CUDA_LIMITER_HYPERVISOR", Kind::Hypervisor, Scopes::AllOnly),
    ("CUDA_LIMITER_CLASS", Kind::Class, Scopes::Both),
    ("CUDA_LIMITER_MPS", Kind::Mps, Scopes::AllOnly),
    ("CUDA_LIMITER_FAST_SWAP", Kind::FastSwap, Scopes::AllOnly),
];

/// Precedence ranks, lower wins; every per-device rank is below every
/// all-devices rank.
pub(super) mod rank {
    pub(crate) const OURS_INDEX: u8 = 0;
    pub(crate) const HAMI_INDEX: u8 = 1;
    pub(crate) const LEGACY_INDEX: u8 = 2;
    pub(crate) const TF_UUID: u8 = 3;
    pub(crate) const TF_INDEX: u8 = 4;
    pub(crate) const OURS_ALL: u8 = 5;
    pub(crate) const HAMI_ALL: u8 = 6;
    pub(crate) const VCUDA_ALL: u8 = 7;
}

pub(super) enum Suffix {
    Index(u32),
    OutOfRange,
    NotIndex,
}

/// A canonical decimal index below `MAX_DEVICES` (no sign, no leading zero).
pub(super) fn parse_index(s: &str) -> Suffix {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) || (s.len() > 1 && s.starts_with('0'))
    {
        return Suffix::NotIndex;
    }
    match s.parse::<u32>() {
        Ok(i) if (i as usize) < MAX_DEVICES => Suffix::Index(i),
        _ => Suffix::OutOfRange,
    }
}

pub(super) enum NameProblem {
    BadSuffix { base: &'static str, suffix: String },
    OutOfRange { index: String },
}

/// Which of our variables `name` is; `Ok(None)` for everything else.
pub(super) fn classify(name: &str) -> Result<Option<(Kind, Scope)>, NameProblem> {
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

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;
    use crate::config::*;

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
}
