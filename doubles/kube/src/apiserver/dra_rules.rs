//! What the API server's validation refuses in the DRA objects
//! (`resource.k8s.io/v1`) the driver and the tests write, as 1.37 does:
//! in a ResourceSlice, more than 128 devices, a device name that is no RFC
//! 1123 label, a device twice, a capacity request policy whose default is
//! outside its range, a taint effect other than `NoSchedule`, `NoExecute`
//! or `None`; in a claim, a request without `deviceClassName`; in a claim
//! or a DeviceClass, a CEL selector that does not parse. A CEL expression
//! is only parsed here (the real server also type-checks it, against the
//! device's declared attributes): a test whose selector must be right runs
//! on the official control plane.

use serde_json::Value;

use super::status::Cause;
use crate::names::label_ok;

/// The most devices one slice may list.
const MAX_DEVICES: usize = 128;

const LABEL: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";

/// The causes that refuse slice `spec`'s devices.
pub(super) fn slice_devices(spec: &Value, causes: &mut Vec<Cause>) {
    let devices = spec["devices"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default();
    if devices.len() > MAX_DEVICES {
        causes.push(Cause::too_many("spec.devices", devices.len(), MAX_DEVICES));
        return;
    }
    let mut seen = std::collections::BTreeSet::new();
    for (i, device) in devices.iter().enumerate() {
        let at = format!("spec.devices[{i}]");
        let name = device["name"].as_str().unwrap_or_default();
        if name.is_empty() {
            causes.push(Cause::required(&format!("{at}.name"), ""));
        } else if name.len() > 63 || !label_ok(name) {
            causes.push(Cause::invalid(&format!("{at}.name"), name, LABEL));
        } else if !seen.insert(name) {
            causes.push(Cause::duplicate(&at, name));
        }
        capacities(&at, device, causes);
        for (j, taint) in device["taints"]
            .as_array()
            .into_iter()
            .flatten()
            .enumerate()
        {
            let effect = taint["effect"].as_str().unwrap_or_default();
            if !matches!(effect, "NoSchedule" | "NoExecute" | "None") {
                causes.push(Cause::not_supported(
                    &format!("{at}.taints[{j}].effect"),
                    effect,
                    &["NoExecute", "NoSchedule", "None"],
                ));
            }
        }
    }
}

/// A capacity's request policy: its default within its valid range.
fn capacities(at: &str, device: &Value, causes: &mut Vec<Cause>) {
    let Some(capacity) = device["capacity"].as_object() else {
        return;
    };
    let parse = |v: &Value| v.as_str().and_then(hypervisor_kubernetes::quantity::parse);
    for (name, value) in capacity {
        let policy = &value["requestPolicy"];
        let (Some(default), Some(range)) = (policy.get("default"), policy.get("validRange")) else {
            continue;
        };
        let field = format!("{at}.capacity[{name}].requestPolicy.validRange.default");
        let text = default.as_str().unwrap_or_default();
        match (
            parse(default),
            parse(&range["min"]),
            range.get("max").and_then(parse),
        ) {
            (Some(d), Some(min), _) if d < min => {
                causes.push(Cause::invalid(
                    &field,
                    text,
                    &format!(
                        "default is less than min: {}",
                        range["min"].as_str().unwrap_or_default()
                    ),
                ));
            }
            (Some(d), _, Some(max)) if d > max => {
                causes.push(Cause::invalid(
                    &field,
                    text,
                    &format!(
                        "default is more than max: {}",
                        range["max"].as_str().unwrap_or_default()
                    ),
                ));
            }
            _ => {}
        }
    }
}

/// The causes that refuse a claim's (or a claim template's) `spec`.
pub(super) fn claim_spec(at: &str, spec: &Value, causes: &mut Vec<Cause>) {
    let requests = spec.pointer("/devices/requests").and_then(Value::as_array);
    for (i, request) in requests.into_iter().flatten().enumerate() {
        let at = format!("{at}.devices.requests[{i}]");
        let Some(exactly) = request.get("exactly") else {
            continue;
        };
        if exactly["deviceClassName"]
            .as_str()
            .is_none_or(str::is_empty)
        {
            causes.push(Cause::required(
                &format!("{at}.exactly.deviceClassName"),
                "",
            ));
        }
        selectors(
            &format!("{at}.exactly.selectors"),
            &exactly["selectors"],
            causes,
        );
    }
}

/// The causes that refuse a DeviceClass.
pub(super) fn device_class(object: &Value, causes: &mut Vec<Cause>) {
    selectors("spec.selectors", &object["spec"]["selectors"], causes);
}

/// Each CEL selector of `list` must parse.
fn selectors(at: &str, list: &Value, causes: &mut Vec<Cause>) {
    for (i, selector) in list.as_array().into_iter().flatten().enumerate() {
        let Some(expression) = selector.pointer("/cel/expression").and_then(Value::as_str) else {
            continue;
        };
        if let Err(error) = cel_parser::parse(expression) {
            causes.push(Cause::invalid(
                &format!("{at}[{i}].cel.expression"),
                expression,
                &format!("compilation failed: {error}"),
            ));
        }
    }
}
