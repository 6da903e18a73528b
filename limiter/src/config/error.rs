//! Configuration errors, and the texts that say what was expected.

use gpushare_utils::MAX_DEVICES;
use gpushare_utils::pod::InvalidPodId;
use gpushare_utils::quote::{Clipped, escaped, quoted};
use gpushare_utils::units::SizeError;

pub(super) const PERCENT_SYNTAX: &str = "a whole number from 0 to 100; 0 and 100 mean unlimited";
pub(super) const JSON_KEY_SYNTAX: &str =
    "a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15";
pub(super) const MEM_JSON_EXAMPLE: &str =
    r#"{"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"}"#;
pub(super) const UP_JSON_EXAMPLE: &str =
    r#"{"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 50} or {"0": 30}"#;
pub(super) const MEM_JSON_VALUE: &str = "bytes as a whole number or a size string such as \"4g\"";
pub(super) const UP_JSON_VALUE: &str = "a whole-number percent from 0 to 100";

/// A configuration error. Every message is one line naming the variable, the
/// value and what was expected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum ConfigError {
    #[error("{var}={} is not valid UTF-8", quoted(.lossy))]
    NotUnicode { var: String, lossy: String },

    #[error(
        "{var}={} has device suffix {}, which is not a device index (expected {base}_<i> with i from 0 to {})",
        quoted(.value),
        escaped(.suffix),
        MAX_DEVICES - 1
    )]
    BadSuffix {
        var: String,
        value: String,
        base: &'static str,
        suffix: String,
    },

    #[error(
        "{var}={} names device {}, but device indices go from 0 to {}",
        quoted(.value),
        Clipped(.index),
        MAX_DEVICES - 1
    )]
    IndexOutOfRange {
        var: String,
        value: String,
        index: String,
    },

    /// `var` may name a JSON key: `TENSOR_FUSION_CUDA_MEM_LIMIT["0"]`.
    #[error("{var}={error}")]
    Size { var: String, error: SizeError },

    #[error("{var}={} is not a percent (expected {PERCENT_SYNTAX})", quoted(.value))]
    Percent { var: String, value: String },

    #[error("{var}={} is not a policy (expected fixed, elastic or none)", quoted(.value))]
    Policy { var: String, value: String },

    #[error("{var}={} is not a switch (expected true or false)", quoted(.value))]
    Switch { var: String, value: String },

    #[error(
        "{soft_var}=\"{soft}\" is below {hard_var}=\"{hard}\" (expected a soft limit, the elastic ceiling, of at least the limit)"
    )]
    SoftBelowHard {
        soft_var: String,
        soft: u8,
        hard_var: String,
        hard: u8,
    },

    #[error("{var}={} has no limit to apply to (expected {needs} to be set too)", quoted(.value))]
    NoLimit {
        var: String,
        value: String,
        needs: String,
    },

    #[error("{var}={} is not a JSON object ({reason}; expected e.g. {example})", quoted(.value))]
    JsonNotObject {
        var: String,
        value: String,
        reason: String,
        example: &'static str,
    },

    #[error("{var} has key {}, which is not {JSON_KEY_SYNTAX}", escaped(.key))]
    JsonKey { var: String, key: String },

    #[error("{var} has {}: {}, which is not {expected}", escaped(.key), Clipped(.value))]
    JsonValue {
        var: String,
        key: String,
        /// The JSON value, as compact JSON text.
        value: String,
        expected: &'static str,
    },

    #[error(
        "{var} names one device twice, as {} and {} (expected each device once)",
        escaped(.first),
        escaped(.second)
    )]
    JsonDuplicate {
        var: String,
        first: String,
        second: String,
    },

    #[error("CUDA_LIMITER_POD={}", .error)]
    Pod { error: InvalidPodId },

    #[error(
        "CUDA_LIMITER_HYPERVISOR={} is empty (expected an address such as http://127.0.0.1:8000, or leave it unset for local mode)",
        quoted(.value)
    )]
    Hypervisor { value: String },

    #[error("{var}={} is not a class (expected latency or batch)", quoted(.value))]
    Class { var: String, value: String },

    #[error(
        "CUDA_LIMITER_MPS={} is not required (expected required, or leave it unset)",
        quoted(.value)
    )]
    Mps { value: String },
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;

    #[test]
    fn error_text_matches_the_contract() {
        let e = err(&[("CUDA_DEVICE_MEMORY_LIMIT_0", "4x")]);
        assert_eq!(
            e.to_string(),
            "CUDA_DEVICE_MEMORY_LIMIT_0=\"4x\" is not a size (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)"
        );
    }

    #[test]
    fn errors_show_at_most_200_characters_of_a_value_or_key() {
        let long = "9".repeat(131_072);
        let key = format!("GPU-{}", "a".repeat(5_000));
        let cases = [
            ("CUDA_DEVICE_MEMORY_LIMIT", format!("{long}x")),
            ("CUDA_LIMITER_SM_LIMIT", long.clone()),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", format!("[{long}]")),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", format!("{{\"{key}\": -1}}")),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", format!("{{\"{long}\": 1}}")),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                format!("{{\"0\": \"{long}\"}}"),
            ),
        ];
        for (name, value) in &cases {
            let msg = err(&[(name, value)]).to_string();
            assert!(msg.len() < 1_000, "{name}: {} bytes: {msg}", msg.len());
            assert!(msg.contains("more characters)"), "{name}: {msg}");
        }
        // A short value is shown whole, with nothing said of the rest.
        let msg = err(&[("CUDA_LIMITER_SM_LIMIT", "101")]).to_string();
        assert!(
            msg.contains("\"101\"") && !msg.contains("more characters"),
            "{msg}"
        );
    }

    #[test]
    fn every_error_is_one_line_naming_the_variable() {
        let table: &[(&str, &str)] = &[
            ("CUDA_LIMITER_MEMORY_LIMIT", "4x"),
            ("CUDA_LIMITER_MEMORY_LIMIT_3", "1\n2"),
            ("CUDA_DEVICE_MEMORY_LIMIT", "-1"),
            ("CUDA_DEVICE_MEMORY_LIMIT_0", ""),
            ("CUDA_MEM_LIMIT_2", "1.5g"),
            ("VCUDA_MEMORY_LIMIT", "99999999999999999999"),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", "{\n\"0\": -1\n}"),
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", "{\n\"0\":\n"),
            ("TENSOR_FUSION_CUDA_UP_LIMIT", "{\"zz\":\n1}"),
            ("CUDA_LIMITER_SM_LIMIT", "101"),
            ("CUDA_LIMITER_SM_LIMIT_1", "-5"),
            ("CUDA_LIMITER_SM_POLICY", "sometimes\r\n"),
            ("CUDA_LIMITER_SM_SOFT_LIMIT_0", "x"),
            ("CUDA_DEVICE_SM_LIMIT", "1e2"),
            ("CUDA_DEVICE_SM_LIMIT_4", "half"),
            ("CUDA_CORE_LIMIT_0", "200"),
            ("CUDA_CORE_SOFT_LIMIT_0", "7"),
            ("CUDA_LIMITER_POD", "a\nb"),
            ("CUDA_LIMITER_HYPERVISOR", "\n"),
            ("CUDA_LIMITER_MPS", "required\n?"),
            ("CUDA_LIMITER_MEMORY_LIMIT_x\ny", "1g"),
        ];
        for &(name, value) in table {
            let msg = err(&[(name, value)]).to_string();
            assert!(!msg.contains(['\n', '\r']), "{name}: {msg:?}");
            assert!(
                msg.starts_with(name.lines().next().unwrap_or(name)),
                "{name}: {msg}"
            );
        }
    }
}
