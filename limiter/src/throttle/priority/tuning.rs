//! How the classes are tuned: the priority variables, read once at load.

use super::gate::DEFAULT_HOLD_NS;

/// Microseconds a batch launch is held after a latency pod's last launch or
/// last work seen in flight; default [`DEFAULT_HOLD_NS`].
pub(super) const HOLD_VARIABLE: &str = "CUDA_LIMITER_PRIORITY_HOLD_US";
/// Launches a batch thread keeps in flight while a latency pod is on its
/// device, 1 to [`MAX_WINDOW`]; default 1.
pub(super) const WINDOW_VARIABLE: &str = "CUDA_LIMITER_PRIORITY_WINDOW";
/// `1` (default) or `0`: whether a latency pod publishes when its next
/// request is expected, for batch pods to be idle by then.
pub(super) const PREDICT_VARIABLE: &str = "CUDA_LIMITER_PRIORITY_PREDICT";
/// Without a hypervisor: milliseconds of a turn, 1 to 100, on the GPUs this
/// process launches on, whose batch pods then take turns ([`super::turns`]);
/// unset: the GPU's turns as the node's table says (none unless a daemon or
/// another process set them). Under a hypervisor its `--turns-gpu` decides.
pub(super) const TURN_VARIABLE: &str = "CUDA_LIMITER_TURN_MS";
/// Most launches a batch thread may keep in flight next to a latency pod.
pub(super) const MAX_WINDOW: usize = 8;

/// How the classes are tuned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tuning {
    pub hold_ns: u64,
    pub window: usize,
    pub predict: bool,
    /// From [`TURN_VARIABLE`], µs; 0: unset.
    pub turn_us: u32,
}

impl Tuning {
    /// From [`HOLD_VARIABLE`], [`WINDOW_VARIABLE`], [`PREDICT_VARIABLE`] and
    /// [`TURN_VARIABLE`]; a bad value is a configuration error.
    pub(crate) fn from_env() -> Result<Self, String> {
        let var = |name| std::env::var(name).ok();
        Self::from_values(
            var(HOLD_VARIABLE).as_deref(),
            var(WINDOW_VARIABLE).as_deref(),
            var(PREDICT_VARIABLE).as_deref(),
            var(TURN_VARIABLE).as_deref(),
        )
    }

    fn from_values(
        hold_us: Option<&str>,
        window: Option<&str>,
        predict: Option<&str>,
        turn_ms: Option<&str>,
    ) -> Result<Self, String> {
        let bad = |name: &str, text: &str, expected: &str| {
            format!("cuda-limiter: configuration error: {name}={text:?} is not {expected}")
        };
        let hold_ns = match hold_us {
            None => DEFAULT_HOLD_NS,
            Some(text) => text
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|us| (1..=100_000).contains(us))
                .ok_or_else(|| bad(HOLD_VARIABLE, text, "a number of µs from 1 to 100000"))?
                .saturating_mul(1_000),
        };
        let window = match window {
            None => 1,
            Some(text) => text
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| (1..=MAX_WINDOW).contains(n))
                .ok_or_else(|| bad(WINDOW_VARIABLE, text, "a number of launches from 1 to 8"))?,
        };
        let predict = match predict.map(str::trim) {
            None | Some("1") => true,
            Some("0") => false,
            Some(_) => {
                return Err(bad(PREDICT_VARIABLE, predict.unwrap_or_default(), "0 or 1"));
            }
        };
        let turn_us = match turn_ms {
            None => 0,
            Some(text) => text
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|ms| (1..=100).contains(ms))
                .ok_or_else(|| bad(TURN_VARIABLE, text, "a number of ms from 1 to 100"))?
                .saturating_mul(1_000),
        };
        Ok(Self {
            hold_ns,
            window,
            predict,
            turn_us,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tuning_defaults_and_bounds() {
        assert_eq!(
            Tuning::from_values(None, None, None, None),
            Ok(Tuning {
                hold_ns: DEFAULT_HOLD_NS,
                window: 1,
                predict: true,
                turn_us: 0,
            })
        );
        assert_eq!(
            Tuning::from_values(Some(" 50 "), Some("2"), Some(" 0"), Some("5")),
            Ok(Tuning {
                hold_ns: 50_000,
                window: 2,
                predict: false,
                turn_us: 5_000,
            })
        );
        assert_eq!(
            Tuning::from_values(None, None, Some("1"), None).map(|t| t.predict),
            Ok(true)
        );
        for (hold, window, predict, turn) in [
            (Some("0"), None, None, None),
            (Some("x"), None, None, None),
            (None, Some("0"), None, None),
            (None, Some("9"), None, None),
            (None, None, Some("yes"), None),
            (None, None, Some(""), None),
            (None, None, Some("2"), None),
            (None, None, None, Some("0")),
            (None, None, None, Some("101")),
            (None, None, None, Some("5ms")),
        ] {
            assert!(
                Tuning::from_values(hold, window, predict, turn).is_err(),
                "{hold:?} {window:?} {predict:?} {turn:?}"
            );
        }
        assert_eq!(
            Tuning::from_values(None, Some("many"), None, None),
            Err("cuda-limiter: configuration error: CUDA_LIMITER_PRIORITY_WINDOW=\"many\" is not a number of launches from 1 to 8".to_owned())
        );
        assert_eq!(
            Tuning::from_values(None, None, Some("on"), None),
            Err("cuda-limiter: configuration error: CUDA_LIMITER_PRIORITY_PREDICT=\"on\" is not 0 or 1".to_owned())
        );
    }
}
