//! `CUDA_LIMITER_FAST_SWAP`: whether the limiter backs the process's large
//! device allocations with the driver's virtual memory management API, so
//! that a swap can move them to host memory and back at the speed of the
//! link (`crate::backing`). A switch, off unless set: a pod that never
//! swaps keeps the driver's own allocations.

use gpushare_utils::units::parse_switch;

use super::ConfigError;
use super::scan::RawVar;

pub(super) fn parse_fast_swap(v: &RawVar) -> Result<bool, ConfigError> {
    parse_switch(&v.value).ok_or_else(|| ConfigError::Switch {
        var: v.name.clone(),
        value: v.value.clone(),
    })
}

#[cfg(test)]
mod tests {
    use crate::config::ConfigError;
    use crate::config::test_support::*;

    #[test]
    fn fast_swap_is_off_unless_switched_on() {
        assert!(!ok(&[]).fast_swap);
        for (value, on) in [
            ("1", true),
            ("true", true),
            (" ON", true),
            ("0", false),
            ("no", false),
        ] {
            assert_eq!(
                ok(&[("CUDA_LIMITER_FAST_SWAP", value)]).fast_swap,
                on,
                "{value:?}"
            );
        }
        for value in ["", "maybe", "2"] {
            let error = err(&[("CUDA_LIMITER_FAST_SWAP", value)]);
            assert!(matches!(error, ConfigError::Switch { .. }), "{value:?}");
        }
        // Not a per-device variable: a suffix makes it someone else's.
        assert!(!ok(&[("CUDA_LIMITER_FAST_SWAP_0", "1")]).fast_swap);
    }
}
