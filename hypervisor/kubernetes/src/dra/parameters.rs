//! This driver's opaque parameters of a claim
//! (`spec.devices.config[].opaque.parameters`, copied by the scheduler into
//! `status.allocation.devices.config`, class configs first, claim configs
//! after and winning):
//!
//! ```yaml
//! apiVersion: gpu.gpushare.dev/v1alpha1
//! kind: GpuShareParameters
//! weight: 2          # default 1
//! policy: elastic    # fixed (default) | elastic | none
//! ceiling: 80        # elastic ceiling in percent (default 100)
//! priority: 10       # default 0
//! class: latency     # batch (default) | latency: served first on the GPU;
//!                    # on a co-run GPU also its MPS client's share of
//!                    # the SMs and priority (see `provision::mps`)
//! oversubscribe: true  # past the quota, serve from pinned host memory (default false)
//! spillLimit: 16Gi   # pod-wide cap of that host memory per GPU (implies
//!                    # oversubscribe; default with it: a quarter of the
//!                    # node's memory; 0 = none)
//! ```
//!
//! Every field of every configuration is read, and each bad one noted
//! ([`ParameterProblem`]), so that a refused claim says all that is wrong
//! with it at once, in these words rather than a parser's.

use gpushare_utils::pod::PodClass;
use serde::Deserialize;
use serde_json::Value;

use crate::quantity;
use hypervisor_core::spec::{self, Policy};
use hypervisor_provision::SharingParams;

/// One thing wrong with this driver's opaque parameters of a claim.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParameterProblem {
    /// The parameters are not a map of fields (their JSON).
    #[error("opaque parameters {0} are not an object of fields")]
    NotAnObject(String),
    /// A field the driver does not know (its name).
    #[error("opaque parameters: unknown field {0}")]
    UnknownField(String),
    /// A field whose value is of the wrong kind or out of its range.
    #[error("opaque parameters: {field} {value} is not {allowed}")]
    Invalid {
        /// The field, as written in a claim.
        field: &'static str,
        /// Its value, as JSON (a string quoted).
        value: String,
        /// What the field takes.
        allowed: &'static str,
    },
}

/// The fields the parameters may have, spelled as in a claim; a field
/// absent or null is unset. Its values are read one by one ([`apply`]),
/// each against its own range, so that every bad one is reported.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawParameters {
    #[serde(default, rename = "apiVersion")]
    _api_version: Option<serde::de::IgnoredAny>,
    #[serde(default, rename = "kind")]
    _kind: Option<serde::de::IgnoredAny>,
    weight: Option<Value>,
    policy: Option<Value>,
    ceiling: Option<Value>,
    priority: Option<Value>,
    class: Option<Value>,
    oversubscribe: Option<Value>,
    spill_limit: Option<Value>,
}

/// Reads one configuration's `parameters` over `params` (what earlier
/// configurations set), field by field; each problem is added to
/// `problems` once.
pub(super) fn apply(
    parameters: &Value,
    params: &mut SharingParams,
    problems: &mut Vec<ParameterProblem>,
) {
    let mut problems = Problems(problems);
    let Some(object) = parameters.as_object() else {
        problems.note(ParameterProblem::NotAnObject(parameters.to_string()));
        return;
    };
    // Each field alone and null is refused only for a name the struct lacks.
    let (known, unknown): (Vec<_>, Vec<_>) = object.clone().into_iter().partition(|(field, _)| {
        let alone = Value::Object([(field.clone(), Value::Null)].into_iter().collect());
        serde_json::from_value::<RawParameters>(alone).is_ok()
    });
    for (field, _) in unknown {
        problems.note(ParameterProblem::UnknownField(field));
    }
    let raw =
        match serde_json::from_value::<RawParameters>(Value::Object(known.into_iter().collect())) {
            Ok(raw) => raw,
            // Not expected: every field left is an optional JSON value.
            Err(error) => {
                problems.note(ParameterProblem::NotAnObject(error.to_string()));
                return;
            }
        };
    let weight = problems.read(
        ("weight", "a whole number from 1 to 4294967295"),
        &raw.weight,
        |v| {
            v.as_u64()
                .and_then(|w| u32::try_from(w).ok())
                .filter(|w| *w >= 1)
        },
    );
    let policy = problems.read(("policy", "fixed, elastic or none"), &raw.policy, |v| {
        v.as_str().and_then(Policy::parse)
    });
    let ceiling = problems.read(
        ("ceiling", "a whole number from 1 to 100"),
        &raw.ceiling,
        |v| {
            v.as_u64()
                .filter(|c| (1..=100).contains(c))
                .and_then(|c| u8::try_from(c).ok())
        },
    );
    let priority = problems.read(
        ("priority", "a whole number from -2147483648 to 2147483647"),
        &raw.priority,
        |v| v.as_i64().and_then(|p| i32::try_from(p).ok()),
    );
    let class = problems.read(("class", "batch or latency"), &raw.class, |v| {
        v.as_str().and_then(PodClass::parse)
    });
    let oversubscribe = problems.read(
        ("oversubscribe", "true or false"),
        &raw.oversubscribe,
        Value::as_bool,
    );
    let spill = problems.read(
        ("spillLimit", "a size (bytes, or a quantity such as 16Gi)"),
        &raw.spill_limit,
        spill_limit,
    );
    if let Some(weight) = weight {
        params.weight = weight;
    }
    if let Some(policy) = policy {
        params.policy = policy;
    }
    if let Some(ceiling) = ceiling {
        params.ceiling = Some(ceiling);
    }
    if let Some(priority) = priority {
        params.priority = priority;
    }
    if let Some(class) = class {
        params.class = class;
    }
    if oversubscribe.is_some() || spill.is_some() {
        params.spill_bytes = spec::spill_cap(oversubscribe, spill);
    }
}

/// The problems found so far, each once.
struct Problems<'a>(&'a mut Vec<ParameterProblem>);

impl Problems<'_> {
    fn note(&mut self, problem: ParameterProblem) {
        if !self.0.contains(&problem) {
            self.0.push(problem);
        }
    }

    /// `value` of `field` read by `parse`; `None` when it is unset, or
    /// when `parse` refuses it (noted, with what the field `allowed`).
    fn read<T>(
        &mut self,
        (field, allowed): (&'static str, &'static str),
        value: &Option<Value>,
        parse: impl FnOnce(&Value) -> Option<T>,
    ) -> Option<T> {
        let value = value.as_ref()?;
        let parsed = parse(value);
        if parsed.is_none() {
            self.note(ParameterProblem::Invalid {
                field,
                value: value.to_string(),
                allowed,
            });
        }
        parsed
    }
}

/// A `spillLimit`: bytes, or a quantity (`16Gi`).
fn spill_limit(value: &Value) -> Option<u64> {
    match value {
        Value::Number(n) => n.as_u64(),
        Value::String(text) => quantity::parse(text),
        _ => None,
    }
}
