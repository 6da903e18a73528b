//! TensorFusion JSON maps (`TENSOR_FUSION_CUDA_MEM_LIMIT`, `TENSOR_FUSION_CUDA_UP_LIMIT`).

use gpushare_utils::units::parse_size;

use super::error::{MEM_JSON_VALUE, UP_JSON_VALUE};
use super::limits::Device;
use super::percent::limited;
use super::scan::RawVar;
use super::vars::{Suffix, parse_index, rank};
use super::{ComputeLimit, ConfigError, DeviceLimits};

/// One JSON value of a TensorFusion map; `Ok(None)` means unlimited.
pub(super) type JsonValueParser<T> =
    fn(&str, &str, &serde_json::Value) -> Result<Option<T>, ConfigError>;

pub(super) fn json_bytes(
    var: &str,
    key: &str,
    value: &serde_json::Value,
) -> Result<Option<u64>, ConfigError> {
    let bytes = match value {
        serde_json::Value::Number(n) => n.as_u64(),
        serde_json::Value::String(s) => Some(parse_size(s).map_err(|error| ConfigError::Size {
            var: format!("{var}[{key:?}]"),
            error,
        })?),
        _ => None,
    };
    match bytes {
        Some(b) => Ok((b != 0).then_some(b)),
        None => Err(json_value_error(var, key, value, MEM_JSON_VALUE)),
    }
}

pub(super) fn json_percent(
    var: &str,
    key: &str,
    value: &serde_json::Value,
) -> Result<Option<ComputeLimit>, ConfigError> {
    match value.as_u64().filter(|p| *p <= 100) {
        Some(p) => Ok(u8::try_from(p)
            .ok()
            .and_then(limited)
            .map(ComputeLimit::fixed)),
        None => Err(json_value_error(var, key, value, UP_JSON_VALUE)),
    }
}

pub(super) fn json_value_error(
    var: &str,
    key: &str,
    value: &serde_json::Value,
    expected: &'static str,
) -> ConfigError {
    ConfigError::JsonValue {
        var: var.to_owned(),
        key: key.to_owned(),
        value: value.to_string(),
        expected,
    }
}

/// A TensorFusion map key: a device index or a GPU/MIG UUID (lowercased).
pub(super) fn json_device(key: &str) -> Option<Device> {
    match parse_index(key) {
        Suffix::Index(i) => return Some(Device::Index(i)),
        Suffix::OutOfRange => return None,
        Suffix::NotIndex => {}
    }
    let prefix = key.get(..4)?;
    let is_uuid = (prefix.eq_ignore_ascii_case("gpu-") || prefix.eq_ignore_ascii_case("mig-"))
        && key.len() > 4
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'/');
    is_uuid.then(|| Device::Uuid(key.to_ascii_lowercase()))
}

/// A JSON object's members in order, a key given twice kept twice: a map
/// keeps only the last, which would let `{"0": 1073741824, "0": 0}` end
/// unlimited where its writer meant a quota.
struct Members(Vec<(String, serde_json::Value)>);

impl<'de> serde::Deserialize<'de> for Members {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visitor;
        impl<'de> serde::de::Visitor<'de> for Visitor {
            type Value = Members;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Members, A::Error> {
                let mut members = Vec::new();
                while let Some(member) = map.next_entry()? {
                    members.push(member);
                }
                Ok(Members(members))
            }
        }
        deserializer.deserialize_map(Visitor)
    }
}

pub(super) fn parse_json_limits<T>(
    v: &RawVar,
    out: &mut DeviceLimits<T>,
    example: &'static str,
    parse_value: JsonValueParser<T>,
) -> Result<(), ConfigError> {
    let not_object = |reason: String| ConfigError::JsonNotObject {
        var: v.name.clone(),
        value: v.value.clone(),
        reason,
        example,
    };
    let json: serde_json::Value =
        serde_json::from_str(&v.value).map_err(|e| not_object(e.to_string()))?;
    match json {
        serde_json::Value::Object(_) => {}
        serde_json::Value::Null => return Err(not_object("found null".to_owned())),
        serde_json::Value::Bool(_) => return Err(not_object("found a boolean".to_owned())),
        serde_json::Value::Number(_) => return Err(not_object("found a number".to_owned())),
        serde_json::Value::String(_) => return Err(not_object("found a string".to_owned())),
        serde_json::Value::Array(_) => return Err(not_object("found an array".to_owned())),
    };
    // Parsed once more, as members: the object above has lost any key
    // given twice.
    let Members(members) = serde_json::from_str(&v.value).map_err(|e| not_object(e.to_string()))?;
    let mut seen: Vec<(Device, &str)> = Vec::with_capacity(members.len());
    for (key, value) in &members {
        let Some(device) = json_device(key) else {
            return Err(ConfigError::JsonKey {
                var: v.name.clone(),
                key: key.clone(),
            });
        };
        if let Some((_, first)) = seen.iter().find(|(d, _)| *d == device) {
            return Err(ConfigError::JsonDuplicate {
                var: v.name.clone(),
                first: (*first).to_owned(),
                second: key.clone(),
            });
        }
        let limit = parse_value(&v.name, key, value)?;
        let rank = match device {
            Device::Uuid(_) => rank::TF_UUID,
            _ => rank::TF_INDEX,
        };
        out.push_member(rank, device.clone(), limit, &v.name, key);
        seen.push((device, key.as_str()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::test_support::*;
    use crate::config::*;

    #[test]
    fn uuids_are_case_insensitive() {
        let lower = r#"{"gpu-3430f778-7a25-704c-9090-8b0bb2478114": 1048576}"#;
        let upper = r#"{"GPU-3430F778-7A25-704C-9090-8B0BB2478114": 1048576}"#;
        let queries = [
            UUID,
            "gpu-3430f778-7a25-704c-9090-8b0bb2478114",
            "GPU-3430F778-7A25-704C-9090-8B0BB2478114",
        ];
        for json in [lower, upper] {
            let c = ok(&[("TENSOR_FUSION_CUDA_MEM_LIMIT", json)]);
            for q in queries {
                assert_eq!(c.memory.resolve(4, Some(q)), Some(MIB), "{json} {q}");
            }
            assert_eq!(c.memory.resolve(4, Some("GPU-other")), None);
        }
        let mig = r#"{"MIG-5c8e6d2a-1b3f-5f0e-8c9d-0a1b2c3d4e5f": 30}"#;
        let c = ok(&[("TENSOR_FUSION_CUDA_UP_LIMIT", mig)]);
        let got = c
            .compute
            .resolve(0, Some("mig-5C8E6D2A-1B3F-5F0E-8C9D-0A1B2C3D4E5F"));
        assert_eq!(got, Some(ComputeLimit::fixed(30)));
    }

    #[test]
    fn a_map_naming_a_device_by_index_and_by_uuid_names_it_twice() {
        for name in [
            "TENSOR_FUSION_CUDA_MEM_LIMIT",
            "TENSOR_FUSION_CUDA_UP_LIMIT",
        ] {
            let json = format!(r#"{{"0": 30, "{}": 0}}"#, UUID.to_uppercase());
            let c = ok(&[(name, json.as_str())]);
            let limits_mix = if name.contains("MEM") {
                c.memory.mixes_indices_and_uuids()
            } else {
                c.compute.mixes_indices_and_uuids()
            };
            assert!(limits_mix, "{name}");
            let twice = |index: u32, uuid: &str| {
                if name.contains("MEM") {
                    c.memory.named_twice(index, uuid)
                } else {
                    c.compute.named_twice(index, uuid)
                }
            };
            let error = twice(0, UUID).expect("device 0 is named twice");
            assert_eq!(
                error.to_string(),
                format!(
                    r#"{name} names one device twice, as "0" and "{}" (expected each device once)"#,
                    UUID.to_uppercase()
                )
            );
            // Another index, or another GPU at index 0: each named once.
            assert_eq!(twice(1, UUID), None, "{name}");
            assert_eq!(twice(0, "GPU-other"), None, "{name}");
        }
        // Keys of one kind only, or of different variables: nothing to check.
        let c = ok(&[("TENSOR_FUSION_CUDA_MEM_LIMIT", r#"{"0": 1, "1": 2}"#)]);
        assert!(!c.memory.mixes_indices_and_uuids());
        let json = format!(r#"{{"{UUID}": 1073741824}}"#);
        let c = ok(&[
            ("TENSOR_FUSION_CUDA_MEM_LIMIT", json.as_str()),
            ("CUDA_LIMITER_MEMORY_LIMIT_0", "2g"),
        ]);
        assert!(!c.memory.mixes_indices_and_uuids());
        assert_eq!(c.memory.named_twice(0, UUID), None);
    }

    #[test]
    fn json_errors() {
        let table: &[(&str, &str, &str)] = &[
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "[1073741824]",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT="[1073741824]" is not a JSON object (found an array; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "1073741824",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT="1073741824" is not a JSON object (found a number; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 1"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT='{"0": 1' is not a JSON object (EOF while parsing an object at line 1 column 7; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT="" is not a JSON object (EOF while parsing a value at line 1 column 0; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 1073741824} or {"0": "2g"})"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": -1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has "0": -1, which is not bytes as a whole number or a size string such as "4g""#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 1.5}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has "0": 1.5, which is not bytes as a whole number or a size string such as "4g""#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": null}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has "0": null, which is not bytes as a whole number or a size string such as "4g""#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": "4x"}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT["0"]="4x" is not a size (expected bytes or a number with k, m, g or t, e.g. 4g, 1024m, 1048576k)"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"foo": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "foo", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"16": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "16", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"01": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "01", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"GPU-": 1}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "GPU-", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                "{\"\\n\": 1}",
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT has key "\n", which is not a GPU UUID (GPU-… or MIG-…) or a device index from 0 to 15"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"GPU-abc": 1, "gpu-ABC": 2}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT names one device twice, as "GPU-abc" and "gpu-ABC" (expected each device once)"#,
            ),
            (
                "TENSOR_FUSION_CUDA_MEM_LIMIT",
                r#"{"0": 1073741824, "0": 0}"#,
                r#"TENSOR_FUSION_CUDA_MEM_LIMIT names one device twice, as "0" and "0" (expected each device once)"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                r#"{"0": 30, "GPU-abc": 50, "0": 100}"#,
                r#"TENSOR_FUSION_CUDA_UP_LIMIT names one device twice, as "0" and "0" (expected each device once)"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                r#"{"0": 101}"#,
                r#"TENSOR_FUSION_CUDA_UP_LIMIT has "0": 101, which is not a whole-number percent from 0 to 100"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                r#"{"0": "50"}"#,
                r#"TENSOR_FUSION_CUDA_UP_LIMIT has "0": "50", which is not a whole-number percent from 0 to 100"#,
            ),
            (
                "TENSOR_FUSION_CUDA_UP_LIMIT",
                "null",
                r#"TENSOR_FUSION_CUDA_UP_LIMIT="null" is not a JSON object (found null; expected e.g. {"GPU-3430f778-7a25-704c-9090-8b0bb2478114": 50} or {"0": 30})"#,
            ),
        ];
        for &(name, value, want) in table {
            assert_eq!(err(&[(name, value)]).to_string(), want, "{name}={value}");
        }
    }
}
