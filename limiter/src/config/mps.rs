//! `CUDA_LIMITER_MPS`: whether this process must run as a client of an MPS
//! server (a pod on a co-run GPU, whose provisioning sets it). `required`
//! (case-insensitive, surrounding whitespace allowed) or unset; any other
//! value is an error, as a typo must not quietly let a co-run pod take the
//! whole GPU's SMs.

use super::ConfigError;
use super::scan::RawVar;

/// Whether MPS must be in effect for CUDA to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) enum MpsMode {
    /// Unset: the limiter does not look.
    #[default]
    Optional,
    /// `required`: after `cuInit`, every device must say MPS is on, or CUDA
    /// is refused.
    Required,
}

pub(super) fn parse_mps(v: &RawVar) -> Result<MpsMode, ConfigError> {
    if v.value.trim().eq_ignore_ascii_case("required") {
        Ok(MpsMode::Required)
    } else {
        Err(ConfigError::Mps {
            value: v.value.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_support::*;

    #[test]
    fn required_or_unset_and_nothing_else() {
        assert_eq!(ok(&[]).mps, MpsMode::Optional);
        for value in ["required", " REQUIRED ", "Required"] {
            assert_eq!(
                ok(&[("CUDA_LIMITER_MPS", value)]).mps,
                MpsMode::Required,
                "{value:?}"
            );
        }
        for value in ["bogus", "", "1", "true", "optional"] {
            let error = err(&[("CUDA_LIMITER_MPS", value)]);
            assert!(matches!(error, ConfigError::Mps { .. }), "{value:?}");
        }
        assert_eq!(
            err(&[("CUDA_LIMITER_MPS", "bogus")]).to_string(),
            "CUDA_LIMITER_MPS=\"bogus\" is not required (expected required, or leave it unset)"
        );
        // Not a per-device variable: a suffix makes it someone else's.
        assert_eq!(
            ok(&[("CUDA_LIMITER_MPS_0", "bogus")]).mps,
            MpsMode::Optional
        );
    }
}
