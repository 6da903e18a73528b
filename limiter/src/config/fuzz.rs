//! The limiter's configuration parser under arbitrary environments: every
//! process of a container runs it at load, so whatever a variable holds it
//! must answer, without panicking, with a configuration or one bounded line
//! that names a variable. A JSON map that gives one key twice is an error
//! whatever else it holds: taking either value silently could turn a quota
//! off.

use proptest::prelude::*;

use super::LimiterConfig;

/// The variables the parser reads, with and without device suffixes.
const NAMES: &[&str] = &[
    "CUDA_LIMITER_MEMORY_LIMIT",
    "CUDA_LIMITER_SM_LIMIT",
    "CUDA_LIMITER_SM_SOFT_LIMIT",
    "CUDA_LIMITER_SM_POLICY",
    "CUDA_LIMITER_POD",
    "CUDA_LIMITER_HYPERVISOR",
    "CUDA_LIMITER_CLASS",
    "CUDA_DEVICE_MEMORY_LIMIT",
    "CUDA_DEVICE_SM_LIMIT",
    "CUDA_MEM_LIMIT",
    "CUDA_CORE_LIMIT",
    "CUDA_CORE_SOFT_LIMIT",
    "VCUDA_MEMORY_LIMIT",
    "TENSOR_FUSION_CUDA_MEM_LIMIT",
    "TENSOR_FUSION_CUDA_UP_LIMIT",
];

fn name() -> impl Strategy<Value = String> {
    (
        prop::sample::select(NAMES),
        prop_oneof![
            Just(String::new()),
            (0u32..20).prop_map(|i| format!("_{i}")),
            "_[A-Za-z0-9]{0,8}",
        ],
    )
        .prop_map(|(base, suffix)| format!("{base}{suffix}"))
}

/// JSON-ish text: maps of device keys to sizes and percents, and near misses.
fn json_like() -> impl Strategy<Value = String> {
    let key = prop_oneof![
        (0u32..20).prop_map(|i| i.to_string()),
        "GPU-[0-9a-f-]{0,40}",
        "MIG-[0-9a-fA-F/-]{0,20}",
        ".{0,12}",
    ];
    let value = prop_oneof![
        any::<i64>().prop_map(|n| n.to_string()),
        (0u32..200).prop_map(|n| n.to_string()),
        "\"[0-9]{1,4}[kmgtx]?\"",
        Just("null".to_owned()),
        Just("1.5".to_owned()),
        Just("[]".to_owned()),
    ];
    prop::collection::vec((key, value), 0..6).prop_map(|members| {
        let body: Vec<String> = members
            .iter()
            .map(|(k, v)| format!("{}: {v}", serde_json::Value::String(k.clone())))
            .collect();
        format!("{{{}}}", body.join(", "))
    })
}

fn value() -> impl Strategy<Value = String> {
    prop_oneof![
        json_like(),
        "[0-9]{0,25}[kKmMgGtTxX%.]?",
        "(fixed|elastic|none|latency|batch|true|false|0|1|100|101)",
        ".{0,40}",
        "\\PC{0,40}",
        (1usize..50_000).prop_map(|n| "9".repeat(n)),
    ]
}

fn environment() -> impl Strategy<Value = Vec<(String, String)>> {
    prop::collection::vec((name(), value()), 0..6)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn any_environment_is_a_config_or_one_bounded_line(vars in environment()) {
        if let Err(error) = LimiterConfig::from_vars(vars.iter().map(|(k, v)| (k.as_str(), v.as_str()))) {
            let line = error.to_string();
            prop_assert!(!line.contains(['\n', '\r']), "{line:?}");
            prop_assert!(line.len() <= 2_000, "{} bytes: {line}", line.len());
            prop_assert!(
                vars.iter().any(|(name, _)| line.starts_with(name.as_str()))
                    || line.starts_with("CUDA_LIMITER_POD"),
                "names no variable: {line}"
            );
        }
    }

    #[test]
    fn a_json_map_with_a_key_given_twice_is_an_error(
        var in prop::sample::select(&["TENSOR_FUSION_CUDA_MEM_LIMIT", "TENSOR_FUSION_CUDA_UP_LIMIT"][..]),
        index in 0u32..16,
        first in 0u32..100,
        second in 0u32..100,
    ) {
        let json = format!("{{\"{index}\": {first}, \"{index}\": {second}}}");
        let parsed = LimiterConfig::from_vars([(var, json.as_str())]);
        prop_assert!(parsed.is_err(), "{var}={json} accepted");
    }
}
